"""Device layer: one `GPU` API, a real NVML backend, a simulated backend and zeusd writes.

`open_gpu()` picks the backend from a spec string so that the same training script runs on a real
GPU (``nvml``), through the zeusd daemon when the job is not root (``zeusd``), or on a CPU-only
machine (``sim:<preset>``), per rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import parse_qsl

from perseus_ext.errors import ConfigError, did_you_mean
from perseus_ext.measurement.gpu.common import (
    GPU,
    GPUError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    PERMISSION_HELP,
    SIMULATED_HINT,
)
from perseus_ext.measurement.gpu.restore_spec import NVMLRestoreSpec, RestoreSpec, SimRestoreSpec, ZeusdRestoreSpec
from perseus_ext.measurement.gpu.sim_board import DEFAULT_TRANSFER_S
from perseus_ext.measurement.gpu.sim_presets import PRESETS, Preset
from perseus_ext.measurement.gpu.simulated import SimulatedGPU
from perseus_ext.measurement.gpu.timeline import (
    CoverageTally,
    DeviceMarker,
    DeviceTimeline,
    HostOnlyTimeline,
    SwitchLatency,
)
from perseus_ext.measurement.gpu.timeline_factory import gpu_switch_latency, open_timeline

logger = logging.getLogger(__name__)

__all__ = [
    "CoverageTally",
    "DeviceMarker",
    "DeviceTimeline",
    "GPU",
    "GPUError",
    "GPUNotSupportedError",
    "GPUPermissionError",
    "GPUUnavailableError",
    "HostOnlyTimeline",
    "NVMLRestoreSpec",
    "PERMISSION_HELP",
    "PRESETS",
    "SIMULATED_HINT",
    "Preset",
    "RestoreSpec",
    "SimRestoreSpec",
    "SimulatedGPU",
    "SwitchLatency",
    "ZeusdRestoreSpec",
    "check_gpu_spec",
    "gpu_switch_latency",
    "open_gpu",
    "open_restore_target",
    "open_timeline",
    "parse_rank_list",
]

ENV_SPEC = "PERSEUS_GPU"
ENV_SEED = "PERSEUS_SIM_SEED"
ENV_SLOWDOWN = "PERSEUS_SIM_SLOWDOWN"
ENV_SLOWDOWN_RANKS = "PERSEUS_SIM_SLOWDOWN_RANKS"
ENV_STATE_DIR = "PERSEUS_SIM_STATE_DIR"

# Query options of "sim:<preset>?key=value&..." and how to parse them.
_SIM_OPTIONS: dict[str, type] = {
    "slowdown": float,
    "seed": int,
    "pace": bool,
    "state_file": str,
    "period": float,
    "noise": float,
    "privileged": bool,
    "switch_ms": float,
    "transition_ms": float,
    "call_ms": float,
    "queue_depth": int,
    "transfer_ms": float,
}


def open_gpu(
    spec: str | None = None, *, local_rank: int = 0, seed: int = 0, rank: int | None = None
) -> GPU:
    """Open this process's GPU.

    spec: ``"nvml"`` or ``"sim:<preset>[?slowdown=1.2&seed=3&pace=0&period=0.1&noise=0.02&
    state_file=/tmp/gpu{rank}.json&privileged=0&switch_ms=20&transition_ms=10&call_ms=0&queue_depth=2&
    transfer_ms=0.1]"``, or ``"zeusd[:<reading spec>]"`` (writes through zeusd, reads from the
    reading backend, default nvml); None reads env ``PERSEUS_GPU`` (default nvml). When
    ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT is set and the opened GPU may not set clocks itself, its
    writes go through zeusd (one INFO line says so).
    local_rank: the CUDA device ordinal this process uses (mapped to NVML through
    CUDA_VISIBLE_DEVICES and UUIDs, never assumed equal to the NVML index).
    rank: global rank for per-rank simulator settings (default env RANK, else local_rank).

    Environment overrides for the simulator: PERSEUS_SIM_SEED (base seed; the GPU of rank r gets
    seed + r), PERSEUS_SIM_SLOWDOWN (slowdown factor) applied to the ranks listed in
    PERSEUS_SIM_SLOWDOWN_RANKS ("2,3" or "0-3"; unset = every rank), PERSEUS_SIM_STATE_DIR (persist
    each rank's clock state to <dir>/sim-gpu-rank<r>.json so the SIGKILL watchdog can restore it).
    """
    spec = (spec if spec is not None else os.environ.get(ENV_SPEC, "nvml")).strip()
    if rank is None:
        rank = _env_int("RANK", local_rank)
    backend, _, rest = spec.partition(":")
    if backend == "zeusd":
        from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
        from perseus_ext.measurement.gpu.zeusd_client import ENV_HOST_PORT, ENV_SOCK_PATH, ZeusdEndpoint

        endpoint = ZeusdEndpoint.from_env()
        if endpoint is None:
            raise ConfigError(f"GPU spec {spec!r} sends clock changes to zeusd, but neither {ENV_SOCK_PATH} "
                              f"nor {ENV_HOST_PORT} is set; export the daemon's socket path "
                              f"({ENV_SOCK_PATH}=/run/zeusd/zeusd.sock) or host:port")
        return ZeusdGPU(_open_reader(rest or "nvml", local_rank=local_rank, rank=rank, seed=seed), endpoint)
    return _through_zeusd_if_needed(_open_reader(spec, local_rank=local_rank, rank=rank, seed=seed))


def _open_reader(spec: str, *, local_rank: int, rank: int, seed: int) -> GPU:
    backend, _, rest = spec.partition(":")
    if backend == "nvml" and not rest:
        from perseus_ext.measurement.gpu.nvml import NVMLGPU

        return NVMLGPU(local_rank)
    if backend == "sim":
        return _open_simulated(spec, rest, rank=rank, seed=seed)
    raise ConfigError(
        f"GPU spec {spec!r} is not understood; use 'nvml', 'zeusd' or 'sim:<preset>' with preset one of "
        f"{', '.join(sorted(PRESETS))} (set it with {ENV_SPEC})"
    )


def _through_zeusd_if_needed(gpu: GPU) -> GPU:
    """`gpu`, or `gpu` with its writes sent to zeusd when ZEUSD_SOCK_PATH / ZEUSD_HOST_PORT is set
    and this process may not set clocks itself (what Zeus's own clients do)."""
    from perseus_ext.measurement.gpu.zeusd_client import ZeusdEndpoint

    endpoint = ZeusdEndpoint.from_env()
    if endpoint is None:
        return gpu
    try:
        if gpu.can_set_clocks():
            return gpu
    except GPUError as err:
        logger.debug("probing %s's clock permission failed: %s", gpu.name, err)
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU

    logger.info("perseus-ext: %s: this process may not set clocks itself and %s is set: clock and "
                "power-limit changes go through %s", gpu.name, endpoint.variable, endpoint.describe())
    return ZeusdGPU(gpu, endpoint)


def check_gpu_spec(spec: str) -> None:
    """A ConfigError unless `spec` is "nvml", "zeusd", "zeusd:<reading spec>" or a simulated spec
    with a known preset and valid options (the config door calls it, so a typo fails before the
    framework builds anything)."""
    spec = spec.strip()
    backend, _, rest = spec.partition(":")
    if backend == "zeusd":  # "zeusd:sim:..." routes a simulated GPU's writes through zeusd (tests)
        spec = rest or "nvml"
        backend, _, rest = spec.partition(":")
    if backend == "sim":
        _parse_simulated(spec, rest)
    elif not (backend == "nvml" and not rest):
        raise ConfigError(f"GPU spec {spec!r} is not understood; use 'nvml', 'zeusd' or 'sim:<preset>' with "
                          f"preset one of {', '.join(sorted(PRESETS))}")


def _parse_simulated(spec: str, rest: str) -> tuple[str, dict[str, Any]]:
    """The preset and options of "sim:<preset>?key=value&...", or a ConfigError naming the typo."""
    preset, _, query = rest.partition("?")
    preset = preset or "a100_sxm"
    if preset not in PRESETS:
        raise ConfigError(
            f"GPU spec {spec!r}: unknown simulated preset {preset!r}{did_you_mean(preset, PRESETS)}; use one of "
            f"{', '.join(sorted(PRESETS))}"
        )
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as err:
        raise ConfigError(f"GPU spec {spec!r}: options are not key=value pairs joined by '&' ({err})") from None
    for key, raw in pairs:
        if key not in _SIM_OPTIONS:
            raise ConfigError(
                f"GPU spec {spec!r}: unknown option {key!r}{did_you_mean(key, _SIM_OPTIONS)}; known: "
                f"{', '.join(_SIM_OPTIONS)}"
            )
        options[key] = _parse_option(spec, key, raw, _SIM_OPTIONS[key])
    return preset, options


def _open_simulated(spec: str, rest: str, *, rank: int, seed: int) -> SimulatedGPU:
    preset, options = _parse_simulated(spec, rest)
    base_seed = _env_int(ENV_SEED, options.pop("seed", seed))
    slowdown = options.pop("slowdown", 1.0)
    if os.environ.get(ENV_SLOWDOWN):
        ranks = parse_rank_list(os.environ.get(ENV_SLOWDOWN_RANKS, ""), ENV_SLOWDOWN_RANKS)
        if ranks is None or rank in ranks:
            slowdown = _parse_option(ENV_SLOWDOWN, ENV_SLOWDOWN, os.environ[ENV_SLOWDOWN], float)
    state_file = options.pop("state_file", None)
    if state_file is None and os.environ.get(ENV_STATE_DIR):
        state_file = os.path.join(os.environ[ENV_STATE_DIR], "sim-gpu-rank{rank}.json")
    if state_file is not None:
        state_file = state_file.format(rank=rank)
    return SimulatedGPU(
        preset,
        seed=base_seed + rank,
        slowdown=slowdown,
        pace=options.pop("pace", True),
        state_file=state_file,
        energy_update_period_s=options.pop("period", 0.1),
        energy_noise=options.pop("noise", 0.02),
        privileged=options.pop("privileged", True),
        rank=rank,
        switch_s=_milliseconds(options.pop("switch_ms", None)),
        transition_s=_milliseconds(options.pop("transition_ms", None)),
        call_s=_milliseconds(options.pop("call_ms", None)),
        queue_depth=options.pop("queue_depth", 2),
        transfer_s=_milliseconds(options.pop("transfer_ms", DEFAULT_TRANSFER_S * 1000.0)),
    )


def _milliseconds(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


def parse_rank_list(text: str, field: str = "ranks") -> set[int] | None:
    """Parse "2,3" or "0-3,6" into a set of ranks; an empty string means all ranks (None)."""
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
            raise ConfigError(
                f"{field}={text!r}: {part!r} is not a rank or a range like '0-3'"
            ) from None
        if first < 0 or last < first:
            raise ConfigError(f"{field}={text!r}: {part!r} is not a valid rank range")
        ranks.update(range(first, last + 1))
    return ranks


def open_restore_target(restore_spec: RestoreSpec) -> GPU:
    """Re-open a GPU from `GPU.restore_spec()` (used by the watchdog process)."""
    if isinstance(restore_spec, SimRestoreSpec):
        return SimulatedGPU(restore_spec.preset, state_file=restore_spec.state_file, pace=False)
    if isinstance(restore_spec, NVMLRestoreSpec):
        from perseus_ext.measurement.gpu.nvml import NVMLGPU

        return NVMLGPU.from_uuid(restore_spec.uuid)
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
    from perseus_ext.measurement.gpu.zeusd_client import ZeusdEndpoint

    endpoint = ZeusdEndpoint(restore_spec.socket_path, restore_spec.host_port)
    return ZeusdGPU(open_restore_target(restore_spec.reader), endpoint, gpu_id=restore_spec.gpu_id)


def _parse_option(spec: str, key: str, raw: str, kind: type) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{spec}: {key}={raw!r} must be a boolean (1/0, true/false)")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{spec}: {key}={raw!r} must be a {kind.__name__}") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None
