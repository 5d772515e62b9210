"""Typed errors shared by every layer of perseus-ext.

Each error says what is wrong *and* how to fix it, so users never have to read a traceback
to learn which field of which file or config key was bad.
"""

from __future__ import annotations

import json
from collections.abc import Iterable


class PerseusError(Exception):
    """Base class of every error perseus-ext raises on purpose."""


class ProfileError(PerseusError, ValueError):
    """A stage profile (CSV or in-memory table) is malformed."""


class ScheduleError(PerseusError, ValueError):
    """A pipeline schedule was asked for with impossible parameters."""


class SolverError(PerseusError, RuntimeError):
    """The frontier solver could not produce a plan."""


class ConfigError(PerseusError, ValueError):
    """A `perseus` config section or `--perseus-*` flag has a bad value."""


def did_you_mean(given: object, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' when one of `choices` is close to `given` (a typo), else ''."""
    import difflib  # here: only a mistake needs it, and every command imports this module

    close = difflib.get_close_matches(str(given), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {json.dumps(close[0])}?)" if close else ""


def unknown_keys_message(where: str, unknown: Iterable[object], known: Iterable[str]) -> str:
    """The one wording of an unknown-key mistake, for every section and sub-section: it names
    each unknown key in full, suggests the known key it is closest to (the usual fix is a typo)
    and lists the known ones."""
    import difflib  # as in `did_you_mean`

    known = sorted(known)
    named = []
    for key in sorted(map(str, unknown)):
        shown = key if key.isidentifier() else json.dumps(key)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named.append(f"{where}.{shown}" + (f" (did you mean {where}.{close[0]}?)" if close else ""))
    return f"unknown key(s) {', '.join(named)}; known keys: {', '.join(known)}"
