"""The GPU spec (`perseus.gpu`, env `PERSEUS_GPU`, `perseus-ext doctor --gpu`) as a typed value.

Why typed: the spec string (`"sim:a40?pace=0&slowdown=1.2"`) is read once, where it enters
(the config door, a command's flag), into a frozen `NvmlSpec`, `SimSpec` or `ZeusdSpec`; the
device layer (`perseus_ext.measurement.gpu.open_gpu`) opens exactly what the spec says and parses
nothing. Every simulator knob is an option of the spec (no environment variable changes what a
simulated GPU does), so a config file says everything about the run it describes.

This module knows the simulated presets by name only (their curves live in the device layer), so
validating a config needs no numpy.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from perseus_ext.config.rules import StrChoice
from perseus_ext.errors import ConfigError, did_you_mean

ENV_GPU = "PERSEUS_GPU"  # the spec when the config gives none
STATE_FILE_IN_DIR = "sim-gpu-rank{rank}.json"  # a rank's clock state under `state_dir`


class SimPreset(StrChoice):
    """The simulated GPU models (`perseus_ext.measurement.gpu.sim.presets.PRESETS` holds their curves)."""

    A100_SXM = "a100_sxm"
    A40 = "a40"
    H100 = "h100"


_FROZEN = ConfigDict(frozen=True, extra="forbid", strict=True)


class NvmlSpec(BaseModel):
    """A real GPU read and set through NVML (the CUDA device of the process's local rank)."""

    model_config = _FROZEN
    backend: Literal["nvml"] = "nvml"

    def __str__(self) -> str:
        return "nvml"


class SimSpec(BaseModel):
    """A simulated GPU: the preset and every option of `sim:<preset>?key=value&...`.

    Field names are the query keys; `None` leaves a value to the simulator's own default."""

    model_config = _FROZEN
    backend: Literal["sim"] = "sim"
    preset: SimPreset = SimPreset.A100_SXM
    seed: int | None = None  # base seed (rank r: seed + r); None: the config's `seed`
    slowdown: Annotated[float, Field(gt=0)] = 1.0  # every computation takes this much longer
    slowdown_ranks: tuple[int, ...] | None = None  # the global ranks slowed down; None: all of them
    pace: bool = True  # sleep through simulated work (False: instant, for tests of the logic)
    state_file: str | None = None  # persist the clock state here ({rank} replaced) for the watchdog
    state_dir: str | None = None  # or under this directory, one file per rank
    period: Annotated[float, Field(ge=0)] = 0.1  # seconds between energy-counter updates
    noise: Annotated[float, Field(ge=0)] = 0.02  # relative noise of each energy-counter update
    privileged: bool = True  # whether this process may set clocks
    switch_ms: Annotated[float, Field(ge=0)] | None = None  # clock switch latency; None: the preset's
    transition_ms: Annotated[float, Field(ge=0)] | None = None  # ramp after the switch; None: the preset's
    call_ms: Annotated[float, Field(ge=0)] | None = None  # host time of one driver call; None: the device's
    queue_depth: Annotated[int, Field(ge=1)] = 2  # launches the device queues ahead
    transfer_ms: Annotated[float, Field(ge=0)] | None = None  # hand-over added to every dependency

    def slows_rank(self, rank: int) -> bool:
        return self.slowdown_ranks is None or rank in self.slowdown_ranks

    def state_file_of(self, rank: int) -> str | None:
        """Where rank `rank` keeps its clock state (None: nowhere, no SIGKILL watchdog)."""
        if self.state_file is not None:
            return self.state_file.format(rank=rank)
        if self.state_dir is not None:
            return os.path.join(self.state_dir, STATE_FILE_IN_DIR.format(rank=rank))
        return None

    def __str__(self) -> str:
        options = []
        for name in self.model_fields_set - {"backend", "preset"}:
            value = getattr(self, name)
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, tuple):
                value = ",".join(map(str, value))
            options.append(f"{name}={value}")
        query = "&".join(sorted(options))
        return f"sim:{self.preset.value}" + (f"?{query}" if query else "")


class ZeusdSpec(BaseModel):
    """Clock and power-limit writes through the node's zeusd daemon; reads from `reader`."""

    model_config = _FROZEN
    backend: Literal["zeusd"] = "zeusd"
    reader: NvmlSpec | SimSpec = NvmlSpec()

    def __str__(self) -> str:
        return "zeusd" if isinstance(self.reader, NvmlSpec) else f"zeusd:{self.reader}"


GpuSpec = NvmlSpec | SimSpec | ZeusdSpec

# How each query value is read (the model then checks its range).
_BOOLEAN_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                  "off": False}
_KINDS: dict[str, type] = {
    name: kind for name, kind in (
        ("slowdown", float), ("seed", int), ("pace", bool), ("state_file", str), ("state_dir", str),
        ("period", float), ("noise", float), ("privileged", bool), ("switch_ms", float),
        ("transition_ms", float), ("call_ms", float), ("queue_depth", int), ("transfer_ms", float),
        ("slowdown_ranks", tuple),
    )
}
_PRESETS = {preset.value for preset in SimPreset}
_PRESET_NAMES = ", ".join(sorted(_PRESETS))


def parse_rank_list(text: str, field: str = "ranks") -> tuple[int, ...] | None:
    """"2,3" or "0-3,6" as sorted ranks; an empty string means every rank (None)."""
    text = text.strip()
    if not text:
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise ConfigError(f"{field}={text!r}: {part!r} is not a rank or a range like '0-3'") from None
        if first < 0 or last < first:
            raise ConfigError(f"{field}={text!r}: {part!r} is not a valid rank range")
        ranks.update(range(first, last + 1))
    return tuple(sorted(ranks))


def _option(spec: str, key: str, raw: str) -> Any:
    kind = _KINDS[key]
    if kind is bool:
        word = _BOOLEAN_WORDS.get(raw.strip().lower())
        if word is None:
            raise ConfigError(f"GPU spec {spec!r}: {key}={raw!r} must be a boolean (1/0, true/false)")
        return word
    if kind is tuple:
        return parse_rank_list(raw, f"GPU spec {spec!r}: {key}")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"GPU spec {spec!r}: {key}={raw!r} must be a {kind.__name__}") from None


def _simulated(spec: str, rest: str) -> SimSpec:
    preset, _, query = rest.partition("?")
    preset = preset or SimPreset.A100_SXM.value
    if preset not in _PRESETS:
        raise ConfigError(f"GPU spec {spec!r}: unknown simulated preset {preset!r}"
                          f"{did_you_mean(preset, _PRESETS)}; use one of {_PRESET_NAMES}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as err:
        raise ConfigError(f"GPU spec {spec!r}: options are not key=value pairs joined by '&' ({err})") from None
    options: dict[str, Any] = {}
    for key, raw in pairs:
        if key not in _KINDS:
            raise ConfigError(f"GPU spec {spec!r}: unknown option {key!r}{did_you_mean(key, _KINDS)}; known: "
                              f"{', '.join(_KINDS)}")
        options[key] = _option(spec, key, raw)
    try:
        return SimSpec(preset=SimPreset(preset), **options)
    except ValidationError as err:
        problem = err.errors(include_url=False)[0]
        key = ".".join(map(str, problem["loc"]))
        raise ConfigError(f"GPU spec {spec!r}: {key}={options.get(key)!r}: {problem['msg'].lower()}") from None


def parse_gpu_spec(text: str) -> GpuSpec:
    """`"nvml"`, `"zeusd[:<reading spec>]"` or `"sim:<preset>[?key=value&...]"` as a typed spec;
    a ConfigError naming the typo (an unknown preset or option, a value of the wrong type)."""
    spec = text.strip()
    backend, _, rest = spec.partition(":")
    if backend == "zeusd":  # "zeusd:sim:..." routes a simulated GPU's writes through zeusd (tests)
        reader = parse_gpu_spec(rest or "nvml")
        if isinstance(reader, ZeusdSpec):
            raise ConfigError(f"GPU spec {spec!r}: zeusd reads through nvml or a simulated GPU, not zeusd")
        return ZeusdSpec(reader=reader)
    if backend == "sim":
        return _simulated(spec, rest)
    if backend == "nvml" and not rest:
        return NvmlSpec()
    raise ConfigError(f"GPU spec {spec!r} is not understood; use 'nvml', 'zeusd' or 'sim:<preset>' with preset "
                      f"one of {_PRESET_NAMES} (in perseus.gpu or env {ENV_GPU})")


def gpu_spec_from_env() -> GpuSpec:
    """The spec env `PERSEUS_GPU` names (default nvml)."""
    return parse_gpu_spec(os.environ.get(ENV_GPU, "") or "nvml")


def is_simulated(spec: GpuSpec) -> bool:
    return isinstance(spec.reader if isinstance(spec, ZeusdSpec) else spec, SimSpec)
