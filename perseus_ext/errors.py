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


def unknown_keys_message(where: str, unknown: Iterable[object], known: Iterable[str]) -> str:
    """The one wording of an unknown-key mistake, for every section and sub-section: it names
    each unknown key in full and lists the known ones (the usual fix is a typo)."""
    shown = (key if key.isidentifier() else json.dumps(key) for key in map(str, unknown))
    names = ", ".join(f"{where}.{key}" for key in sorted(shown))
    return f"unknown key(s) {names}; known keys: {', '.join(sorted(known))}"
