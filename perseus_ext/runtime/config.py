"""The `"perseus"` configuration section, validated up front.

Why a hand-written schema: the section arrives inside a framework config (a DeepSpeed JSON file,
Megatron flags), so a bad key must fail at initialisation with a message naming
`perseus.<key>` and the fix — not hours later inside a training step. This module imports
neither torch nor numpy, so configs can be checked anywhere (CLI, CI, the launcher).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from perseus_ext.errors import ConfigError

PREFIX = "perseus"
MODES = ("optimize", "observe")


@dataclass(frozen=True)
class SimulatedWorkload:
    """Seconds one forward/backward of one microbatch takes at the max clock, per stage.

    Only used with a simulated GPU: the runtime paces each computation to this duration at the
    current clock (the real CPU work counts towards it), so energy and time follow the GPU model
    while the training math is untouched.
    """

    forward_seconds: tuple[float, ...]
    backward_seconds: tuple[float, ...]

    def seconds(self, stage: int, kind: str) -> float:
        table = self.forward_seconds if kind == "forward" else self.backward_seconds
        return table[stage] if len(table) > 1 else table[0]

    def check_stages(self, num_stages: int) -> None:
        for name in ("forward_seconds", "backward_seconds"):
            values = getattr(self, name)
            if len(values) not in (1, num_stages):
                raise ConfigError(
                    f"{PREFIX}.simulated_workload.{name} has {len(values)} entries but the "
                    f"pipeline has {num_stages} stages; give one number or one per stage"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"forward_seconds": list(self.forward_seconds), "backward_seconds": list(self.backward_seconds)}


@dataclass(frozen=True)
class PerseusConfig:
    """Every knob of the runtime; see docs/deepspeed.md for the user-facing table."""

    enabled: bool = False
    mode: str = "optimize"
    gpu: str | None = None
    seed: int = 0
    dry_run: bool | None = None
    strict: bool = False
    warmup_iterations: int = 2
    profiling_iterations_per_clock: int = 1
    candidate_clocks: tuple[int, ...] | None = None
    clock_stride: int = 1
    early_stop: bool = True
    early_stop_patience: int = 2
    blocking_power_w: float | None = None
    profile_path: str | None = None
    frontier_path: str | None = None
    solve_in_background: bool = True
    solver: Mapping[str, Any] | None = field(default=None, hash=False)
    control_timeout_s: float = 1800.0
    straggler_check_interval: int = 10
    straggler_threshold: float = 0.05
    straggler_hysteresis: float = 0.02
    straggler_confirmations: int = 2
    communication_clock: int | str | None = None
    log_interval: int = 1
    log_path: str | None = None
    summary_path: str | None = None
    simulated_workload: SimulatedWorkload | None = None
    policy: Mapping[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "PerseusConfig":
        """Validate a `"perseus"` section; raise ConfigError naming the first bad key."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{PREFIX} must be an object of settings, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(f'{PREFIX}.{k}' for k in unknown)}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for key, raw in data.items():
            values[key] = _PARSERS[key](raw, f"{PREFIX}.{key}")
        config = cls(**values)
        config._check_combinations()
        return config

    def _check_combinations(self) -> None:
        if self.straggler_hysteresis >= self.straggler_threshold:
            raise ConfigError(
                f"{PREFIX}.straggler_hysteresis ({self.straggler_hysteresis}) must be smaller "
                f"than {PREFIX}.straggler_threshold ({self.straggler_threshold}), or plans "
                f"would never return after a straggler recovers"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SimulatedWorkload):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out


# --------------------------------------------------------------------------- field parsers
def _bool(raw: Any, key: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(f"{key} must be true or false, got {raw!r}")
    return raw


def _optional_bool(raw: Any, key: str) -> bool | None:
    return None if raw is None else _bool(raw, key)


def _int(raw: Any, key: str, minimum: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{key} must be an integer, got {raw!r}")
    if raw < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {raw}")
    return raw


def _int_at_least(minimum: int):
    return lambda raw, key: _int(raw, key, minimum)


def _number(raw: Any, key: str, *, minimum: float, inclusive: bool) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise ConfigError(f"{key} must be a finite number, got {raw!r}")
    if raw < minimum or (raw == minimum and not inclusive):
        relation = ">=" if inclusive else ">"
        raise ConfigError(f"{key} must be {relation} {minimum}, got {raw}")
    return float(raw)


def _fraction(raw: Any, key: str) -> float:
    value = _number(raw, key, minimum=0.0, inclusive=True)
    if value >= 1.0:
        raise ConfigError(f"{key} must be a fraction below 1 (e.g. 0.05 = 5%), got {raw}")
    return value


def _positive_fraction(raw: Any, key: str) -> float:
    value = _fraction(raw, key)
    if value == 0.0:
        raise ConfigError(f"{key} must be > 0 (e.g. 0.05 = 5%), got {raw}")
    return value


def _optional_power(raw: Any, key: str) -> float | None:
    return None if raw is None else _number(raw, key, minimum=0.0, inclusive=False)


def _optional_str(raw: Any, key: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{key} must be a non-empty string, got {raw!r}")
    return raw


def _mode(raw: Any, key: str) -> str:
    if raw not in MODES:
        raise ConfigError(f"{key} must be one of {', '.join(MODES)}, got {raw!r}")
    return raw


def _clock_list(raw: Any, key: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(f"{key} must be a non-empty list of SM clocks in MHz, got {raw!r}")
    clocks = [_int(c, f"{key}[{i}]", 1) for i, c in enumerate(raw)]
    if len(set(clocks)) != len(clocks):
        raise ConfigError(f"{key} lists a clock twice: {clocks}")
    return tuple(sorted(clocks, reverse=True))


def _communication_clock(raw: Any, key: str) -> int | str | None:
    if raw is None or raw == "min":
        return raw
    if isinstance(raw, str):
        raise ConfigError(f"{key} must be null, \"min\" or a clock in MHz, got {raw!r}")
    return _int(raw, key, 1)


def _seconds_list(raw: Any, key: str) -> tuple[float, ...]:
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    if not items:
        raise ConfigError(f"{key} must be a number of seconds or a list of them (one per stage)")
    return tuple(
        _number(v, f"{key}[{i}]" if isinstance(raw, (list, tuple)) else key, minimum=0.0, inclusive=False)
        for i, v in enumerate(items)
    )


def _workload(raw: Any, key: str) -> SimulatedWorkload | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be an object with forward_seconds and backward_seconds")
    allowed = {"forward_seconds", "backward_seconds"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{key}.{k}' for k in unknown)}; known: {', '.join(sorted(allowed))}")
    missing = sorted(allowed - set(raw))
    if missing:
        raise ConfigError(f"{key} needs {', '.join(f'{key}.{k}' for k in missing)}")
    return SimulatedWorkload(
        _seconds_list(raw["forward_seconds"], f"{key}.forward_seconds"),
        _seconds_list(raw["backward_seconds"], f"{key}.backward_seconds"),
    )


def _mapping(raw: Any, key: str, example: str) -> Mapping[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be an object (e.g. {example}), got {raw!r}")
    return dict(raw)


_PARSERS = {
    "enabled": _bool,
    "mode": _mode,
    "gpu": _optional_str,
    "seed": _int_at_least(0),
    "dry_run": _optional_bool,
    "strict": _bool,
    "warmup_iterations": _int_at_least(0),
    "profiling_iterations_per_clock": _int_at_least(1),
    "candidate_clocks": _clock_list,
    "clock_stride": _int_at_least(1),
    "early_stop": _bool,
    "early_stop_patience": _int_at_least(1),
    "blocking_power_w": _optional_power,
    "profile_path": _optional_str,
    "frontier_path": _optional_str,
    "solve_in_background": _bool,
    "solver": lambda raw, key: _mapping(raw, key, example='{"min_grid_points": 300}'),
    "control_timeout_s": lambda raw, key: _number(raw, key, minimum=0.0, inclusive=False),
    "straggler_check_interval": _int_at_least(1),
    "straggler_threshold": _positive_fraction,
    "straggler_hysteresis": _fraction,
    "straggler_confirmations": _int_at_least(1),
    "communication_clock": _communication_clock,
    "log_interval": _int_at_least(0),
    "log_path": _optional_str,
    "summary_path": _optional_str,
    "simulated_workload": _workload,
    "policy": lambda raw, key: _mapping(raw, key, example='{"name": "perseus"}'),
}
