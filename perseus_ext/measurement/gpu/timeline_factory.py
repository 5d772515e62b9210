"""Which timeline and which clock-change latency a GPU gets: the factories over the timeline's
implementations (`cuda_timeline.py` for real GPUs, the simulated GPU's own device), kept out of the
abstract `timeline.py` so that the implementations can import it without a cycle."""

from __future__ import annotations

from perseus_ext.measurement.gpu.common import GPU
from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline
from perseus_ext.measurement.gpu.timeline import (
    CONSERVATIVE_SWITCH_LATENCY,
    NO_LATENCY,
    NVML_SWITCH_LATENCIES,
    DeviceTimeline,
    HostOnlyTimeline,
    OwnTimeline,
    SwitchLatency,
)


def open_timeline(gpu: GPU | None, *, job_id: str, rank: int, peer_timeout_s: float | None = None) -> DeviceTimeline:
    """The compute stream of this process's GPU.

    A GPU with its own timeline (`OwnTimeline`: the simulated GPU) gets its simulated device,
    joined to the cross-rank board of `job_id` (all ranks of one job must pass the same job_id,
    and a job_id must not be reused by a concurrent job); an NVML GPU gets `CudaTimeline` when torch has CUDA, else `HostOnlyTimeline`.
    """
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU  # here: httpx only where a runtime starts

    if isinstance(gpu, ZeusdGPU):  # the work runs on the GPU it reads from
        return open_timeline(gpu.reader, job_id=job_id, rank=rank)
    if isinstance(gpu, OwnTimeline):
        return gpu.open_timeline(job_id=job_id, rank=rank, peer_timeout_s=peer_timeout_s)
    if gpu is not None and _cuda_available():
        return CudaTimeline()
    return HostOnlyTimeline()


def gpu_switch_latency(gpu: GPU | None) -> SwitchLatency:
    """How long a clock change takes on `gpu`: the simulator's configured latency, else the
    default for the model (matched by NVML name), else a conservative default. Through zeusd,
    the daemon's measured round trip comes on top of the set call's own duration (`call_s`):
    the change leaves the worker that much earlier than it reaches the driver, and the clock
    starts to change `switch_s` after the call returns, as without zeusd."""
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU

    if gpu is None:
        return NO_LATENCY
    if isinstance(gpu, ZeusdGPU):
        direct = gpu_switch_latency(gpu.reader)
        return SwitchLatency(direct.switch_s, direct.transition_s, call_s=direct.call_s + gpu.round_trip_s)
    if isinstance(gpu, OwnTimeline):
        return gpu.switch_latency
    name = gpu.name.upper()
    for pattern, latency in NVML_SWITCH_LATENCIES:
        if pattern in name:
            return latency
    return CONSERVATIVE_SWITCH_LATENCY


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
