"""Read-only measurements of one GPU: its clocks, power, energy counter and CUDA event timing.

It never changes clocks or the power limit, so it is safe on shared machines. `perseus-ext
doctor` prints it together with the rest of the environment; on a CPU-only machine
`--gpu sim:a100_sxm` shows what the simulator models.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

from perseus_ext.measurement.gpu import GPU
from perseus_ext.measurement.windows import calibrate_counter


def probe_gpu(gpu: GPU, updates: int = 30) -> dict[str, Any]:
    """The GPU's identity, clock range, power, permission and energy counter behaviour
    (`updates` counter changes watched to learn its update period)."""
    clocks = gpu.supported_sm_clocks()
    return {
        "gpu": gpu.name,
        "uuid": gpu.uuid,
        "sm_clock_mhz": gpu.sm_clock(),
        "supported_sm_clocks": [clocks[0], clocks[-1]],
        "power_w": gpu.power_w(),
        "power_limit_w": gpu.power_limit_w(),
        "can_set_clocks": gpu.can_set_clocks(),
        "energy_counter": asdict(calibrate_counter(gpu, updates=updates)),
    }


def cuda_event_timing(samples: int = 200) -> dict[str, Any]:
    """CPU cost of recording a CUDA event, the smallest measurable interval, event vs wall time."""
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "torch sees no CUDA device"}
    record_costs, empty_ms = [], []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin = time.perf_counter_ns()
        start.record()
        record_costs.append(time.perf_counter_ns() - begin)
        end.record()
        end.synchronize()
        empty_ms.append(start.elapsed_time(end))
    matrix = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.perf_counter()
    start.record()
    for _ in range(20):
        matrix @ matrix
    end.record()
    end.synchronize()
    wall = time.perf_counter() - wall
    return {
        "available": True,
        "device": torch.cuda.get_device_name(),
        "record_cost_us_median": statistics.median(record_costs) / 1000,
        "empty_interval_ms_median": statistics.median(empty_ms),
        "matmul_event_ms": start.elapsed_time(end),
        "matmul_wall_ms": wall * 1000,
    }
