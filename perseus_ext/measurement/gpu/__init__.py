"""Device layer: one `GPU` API, a real NVML backend, a simulated backend and zeusd writes.

`open_gpu()` opens the backend a typed GPU spec names (`perseus_ext.config.gpu`: the config
door parses the spec string once) so that the same training script runs on a real GPU
(``nvml``), through the zeusd daemon when the job is not root (``zeusd``), or on a CPU-only
machine (``sim:<preset>``), per rank. Each backend is imported when a spec asks for it: the
simulator (`perseus_ext.measurement.gpu.sim`: `SimulatedGPU`, its presets) is never loaded by a
job on real GPUs.
"""

from __future__ import annotations

import logging
import os

from perseus_ext.config.gpu import GpuSpec, NvmlSpec, SimSpec, ZeusdSpec, gpu_spec_from_env, parse_gpu_spec
from perseus_ext.errors import ConfigError
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
    "SIMULATED_HINT",
    "RestoreSpec",
    "SimRestoreSpec",
    "SwitchLatency",
    "ZeusdRestoreSpec",
    "gpu_switch_latency",
    "open_gpu",
    "open_restore_target",
    "open_timeline",
]

def open_gpu(
    spec: GpuSpec | str | None = None, *, local_rank: int = 0, seed: int = 0, rank: int | None = None
) -> GPU:
    """Open this process's GPU.

    spec: a typed `GpuSpec` (the config door's `PerseusConfig.gpu_spec`); a spec string
    (``"nvml"``, ``"zeusd[:<reading spec>]"``, ``"sim:<preset>[?options]"``, the options in
    `perseus_ext.config.gpu.SimSpec` and docs/device.md) is parsed here, where it enters; None
    reads env ``PERSEUS_GPU`` (default nvml). When ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT is set and
    the opened GPU may not set clocks itself, its writes go through zeusd (one INFO line says so).
    local_rank: the CUDA device ordinal this process uses (mapped to NVML through
    CUDA_VISIBLE_DEVICES and UUIDs, never assumed equal to the NVML index).
    seed: base seed of a simulated GPU whose spec sets none (rank r gets seed + r).
    rank: global rank for per-rank simulator settings (default env RANK, else local_rank).
    """
    if spec is None:
        spec = gpu_spec_from_env()
    elif isinstance(spec, str):
        spec = parse_gpu_spec(spec)
    if rank is None:
        rank = _env_int("RANK", local_rank)
    if isinstance(spec, ZeusdSpec):
        from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
        from perseus_ext.measurement.gpu.zeusd_client import ENV_HOST_PORT, ENV_SOCK_PATH, ZeusdEndpoint

        endpoint = ZeusdEndpoint.from_env()
        if endpoint is None:
            raise ConfigError(f"GPU spec {str(spec)!r} sends clock changes to zeusd, but neither {ENV_SOCK_PATH} "
                              f"nor {ENV_HOST_PORT} is set; export the daemon's socket path "
                              f"({ENV_SOCK_PATH}=/run/zeusd/zeusd.sock) or host:port")
        return ZeusdGPU(_open_reader(spec.reader, local_rank=local_rank, rank=rank, seed=seed), endpoint)
    return _through_zeusd_if_needed(_open_reader(spec, local_rank=local_rank, rank=rank, seed=seed))


def _open_reader(spec: NvmlSpec | SimSpec, *, local_rank: int, rank: int, seed: int) -> GPU:
    if isinstance(spec, SimSpec):
        return _open_simulated(spec, rank=rank, seed=seed)
    from perseus_ext.measurement.gpu.nvml import NVMLGPU

    return NVMLGPU(local_rank)


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


def _open_simulated(spec: SimSpec, *, rank: int, seed: int) -> GPU:
    from perseus_ext.measurement.gpu.sim import DEFAULT_TRANSFER_S, SimulatedGPU

    return SimulatedGPU(
        spec.preset.value,
        seed=(spec.seed if spec.seed is not None else seed) + rank,
        slowdown=spec.slowdown if spec.slows_rank(rank) else 1.0,
        pace=spec.pace,
        state_file=spec.state_file_of(rank),
        energy_update_period_s=spec.period,
        energy_noise=spec.noise,
        privileged=spec.privileged,
        rank=rank,
        switch_s=_seconds(spec.switch_ms),
        transition_s=_seconds(spec.transition_ms),
        call_s=_seconds(spec.call_ms),
        queue_depth=spec.queue_depth,
        transfer_s=DEFAULT_TRANSFER_S if spec.transfer_ms is None else spec.transfer_ms / 1000.0,
    )


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000.0


def open_restore_target(restore_spec: RestoreSpec) -> GPU:
    """Re-open a GPU from `GPU.restore_spec()` (used by the watchdog process)."""
    if isinstance(restore_spec, SimRestoreSpec):
        from perseus_ext.measurement.gpu.sim import SimulatedGPU

        return SimulatedGPU(restore_spec.preset, state_file=restore_spec.state_file, pace=False)
    if isinstance(restore_spec, NVMLRestoreSpec):
        from perseus_ext.measurement.gpu.nvml import NVMLGPU

        return NVMLGPU.from_uuid(restore_spec.uuid)
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
    from perseus_ext.measurement.gpu.zeusd_client import ZeusdEndpoint

    endpoint = ZeusdEndpoint(restore_spec.socket_path, restore_spec.host_port)
    return ZeusdGPU(open_restore_target(restore_spec.reader), endpoint, gpu_id=restore_spec.gpu_id)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None
