"""Device-ordered actuation on a real GPU, in dry-run: what only hardware can show.

Never changes the GPU's clocks or power limit: the controller runs in dry-run and records the
clock changes it would make, timestamped in device order. A few torch transformer blocks run
forward and backward in a loop (one "computation" per block pass) with the hooks attached the
way the runtime attaches them, and the script reports:

* hook cost on the training thread per computation (marker + queued request), median/p99 µs;
* how far the host leads the device (host launch time vs the CUDA event at the computation's
  start, on the same clock), median/max ms;
* how late the controller's worker notices the device reaching a boundary, median/p99 ms;
* NVML energy-counter read latency, median/p99 µs;
* the clock coverage estimated from CUDA-event timestamps, the worker's issue times and the
  published switching latency (docs/device.md), for a plan alternating two clocks.

Run on a GPU machine (needs torch with CUDA and nvidia-ml-py):

    python benchmarks/gpu_actuation.py --layers 4 --hidden 4096 --iterations 20 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (one computation each)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import torch

    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.actuation.sequencer import ClockSequencer
    from perseus_ext.measurement.coverage import estimate_coverage
    from perseus_ext.measurement.gpu import open_gpu
    from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline
    from perseus_ext.measurement.gpu.timeline_factory import gpu_switch_latency

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    gpu = open_gpu("nvml")
    latency = gpu_switch_latency(gpu)
    clocks = gpu.supported_sm_clocks()
    plan_clocks = (clocks[0], clocks[len(clocks) // 3])
    blocks = torch.nn.ModuleList(
        torch.nn.TransformerEncoderLayer(args.hidden, nhead=max(1, args.hidden // 128), batch_first=True)
        for _ in range(args.layers)).cuda().to(torch.bfloat16)
    data = torch.randn(args.batch, args.sequence, args.hidden, device="cuda", dtype=torch.bfloat16)
    controller = FrequencyController(gpu, dry_run=True, watchdog=False)  # never touches the GPU
    timeline = CudaTimeline()
    sequencer = ClockSequencer(controller, timeline, latency=latency)
    computations = 2 * args.layers
    plan = tuple(plan_clocks[(k // 2) % 2] for k in range(computations))
    hook_us: list[float] = []
    host_lead_ms: list[float] = []
    reads_us: list[float] = []
    traces = []
    durations = None
    for iteration in range(args.iterations):
        start = sequencer.start_iteration(iteration, plan, durations)
        controller.observe(start, iteration)
        launches = []
        activations = [data.requires_grad_(True)]
        outputs = []
        for block in blocks:  # forward: one computation per block
            began = time.perf_counter_ns()
            sequencer.computation_started()
            launches.append(time.perf_counter())
            out = block(activations[-1])
            sequencer.computation_finished()
            hook_us.append((time.perf_counter_ns() - began) / 1000.0)
            outputs.append(out)
            activations.append(out)
        grad = torch.ones_like(outputs[-1])
        for index in reversed(range(len(outputs))):  # backward: one computation per block
            began = time.perf_counter_ns()
            sequencer.computation_started()
            launches.append(time.perf_counter())
            (grad,) = torch.autograd.grad(outputs[index], [activations[index]], grad, retain_graph=True)
            sequencer.computation_finished()
            hook_us.append((time.perf_counter_ns() - began) / 1000.0)
        traces.append((sequencer.trace, launches))
        if iteration == 1:  # planned durations from the first timed iteration, for issuing ahead
            torch.cuda.synchronize()
            spans = sequencer.trace.device_spans()
            durations = tuple(end - begin for begin, end, _ in spans)
        began = time.perf_counter_ns()
        gpu.energy_mj()
        reads_us.append((time.perf_counter_ns() - began) / 1000.0)
    torch.cuda.synchronize()
    controller.flush(30)
    notices = [1000.0 * (o.noticed_s - o.device_time_s) for o in controller.observations()]
    changes = [(c.issued_s, c.mhz) for c in controller.drain_changes()]
    all_spans = []
    for trace, launches in traces[2:]:
        spans = trace.device_spans()
        all_spans.extend(spans)
        host_lead_ms.extend(1000.0 * (begin - launched) for (begin, _, _), launched in zip(spans, launches))
    tally = estimate_coverage(all_spans, changes, latency, None, default_clock_mhz=clocks[0])
    controller.close()
    figures = {
        "gpu": gpu.name, "switch_latency_s": latency.switch_s, "transition_s": latency.transition_s,
        "hook_us_median": statistics.median(hook_us), "hook_us_p99": _percentile(hook_us, 0.99),
        "host_lead_ms_median": statistics.median(host_lead_ms), "host_lead_ms_max": max(host_lead_ms),
        "notice_delay_ms_median": statistics.median(notices), "notice_delay_ms_p99": _percentile(notices, 0.99),
        "nvml_energy_read_us_median": statistics.median(reads_us), "nvml_energy_read_us_p99": _percentile(reads_us, 0.99),
        "estimated_coverage": tally.coverage,
    }
    for key, value in figures.items():
        print(f"{key:<30} {value:.3f}" if isinstance(value, float) else f"{key:<30} {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
