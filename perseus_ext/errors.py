"""Typed errors shared by every layer of perseus-ext, and the list of every error it raises.

Each error says what is wrong *and* how to fix it, so users never have to read a traceback
to learn which field of which file or config key was bad. Every error perseus-ext raises on
purpose is a `PerseusError`; the ones a layer adds live beside the code that raises them, and
all are listed here (tests/test_config_errors.py keeps this list complete):

    PerseusError
    ├── ProfileError            a stage profile is malformed                            (here)
    ├── ScheduleError           a schedule asked for with impossible parameters         (here)
    ├── SolverError             the frontier solver cannot produce a plan               (here)
    ├── ConfigError             a config key or flag has a bad value; `.keys` names it  (here)
    │   ├── CarbonSignalError   a carbon or budget source is unusable           (policies/carbon.py)
    │   ├── StoreError          the batch-size store cannot be used             (policies/bso_store.py)
    │   ├── FlagError           a --perseus-* flag, with the flags to blame     (adapters/megatron_args.py)
    │   └── StrictControlError  `strict` and no permission to set clocks        (measurement/gpu/common.py)
    ├── InputError              an input file is unreadable or malformed        (inputs.py)
    ├── MeasurementError        a measurement window cannot be evaluated        (measurement/windows.py)
    ├── PlottingError           a figure cannot be drawn                        (observability/plotting.py)
    ├── FetchError              one fetch of a carbon or budget endpoint failed (policies/carbon.py)
    ├── PerseusEarlyStop        a recurring job's run passed its cost limit     (policies/recurring_job.py)
    └── GPUError                a GPU call failed                               (measurement/gpu/common.py)
        ├── GPUUnavailableError, GPUPermissionError (> StrictControlError), GPUNotSupportedError
        └── ZeusdError > ZeusdUnreachableError, ZeusdAuthError, ZeusdCapabilityError
                                                                        (measurement/gpu/zeusd_client.py)
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
    """A `perseus` config section or `--perseus-*` flag has a bad value.

    `keys` are the config keys the error is about, in full (`perseus.straggler_threshold`,
    `perseus.policy.eta`; list positions dropped), so a front end can name its own spelling of
    them (a Megatron flag, a DeepSpeed key) from the error itself rather than from its wording.
    Empty when the error is about no key (a file that cannot be read, an environment variable).
    """

    def __init__(self, *args: object, keys: Iterable[str] = ()) -> None:
        super().__init__(*args)
        self.keys: tuple[str, ...] = tuple(dict.fromkeys(keys))

    def __reduce__(self) -> tuple:
        # The keys survive pickling (errors cross process boundaries, e.g. a background solve).
        return _rebuild_config_error, (type(self), self.args, self.keys)


def _rebuild_config_error(cls: type[ConfigError], args: tuple, keys: tuple[str, ...]) -> ConfigError:
    return cls(*args, keys=keys)


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
