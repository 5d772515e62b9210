"""Measure what a GPU's energy counter, CUDA events and the clock hook really cost/offer.

Read-only: it never changes clocks or the power limit (the controller runs in dry-run), so it is
safe on shared machines. Run on a GPU node and keep the output with the results:

    python -m perseus_ext.measurement.probe --gpu nvml [--updates 30] [--json probe.json]

On a CPU-only machine, `--gpu sim:a100_sxm` shows what the simulator models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from perseus_ext.errors import PerseusError
from perseus_ext.measurement.gpu import GPU, open_gpu
from perseus_ext.measurement.windows import calibrate_counter


def hook_cost_us(gpu: GPU, calls: int = 20000) -> dict[str, float]:
    """Median/p99 cost of set_clock() in dry-run mode (the GPU is not touched)."""
    from perseus_ext.actuation.controller import FrequencyController

    clocks = gpu.supported_sm_clocks()[:8]
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    costs = []
    for index in range(calls):
        start = time.perf_counter_ns()
        controller.set_clock(clocks[index % len(clocks)])
        costs.append(time.perf_counter_ns() - start)
    controller.close()
    costs.sort()
    return {"median_us": costs[len(costs) // 2] / 1000, "p99_us": costs[int(0.99 * len(costs))] / 1000}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read-only GPU measurement probe")
    parser.add_argument("--gpu", default=None, help="open_gpu spec (default: $PERSEUS_GPU or nvml)")
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--updates", type=int, default=30, help="energy counter changes to watch")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        gpu = open_gpu(args.gpu, local_rank=args.local_rank)
        calibration = calibrate_counter(gpu, updates=args.updates)
        results = {
            "gpu": gpu.name,
            "uuid": gpu.uuid,
            "sm_clock_mhz": gpu.sm_clock(),
            "supported_sm_clocks": [gpu.supported_sm_clocks()[0], gpu.supported_sm_clocks()[-1]],
            "power_w": gpu.power_w(),
            "power_limit_w": gpu.power_limit_w(),
            "can_set_clocks": gpu.can_set_clocks(),
            "energy_counter": asdict(calibration),
            "cuda_events": cuda_event_timing(),
            "set_clock_hook": hook_cost_us(gpu),
        }
    except PerseusError as err:
        print(f"probe failed: {err}", file=sys.stderr)
        return 1
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
