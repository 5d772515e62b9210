"""Device-ordered actuation on a real GPU, in dry-run: what only hardware can show.

    python benchmarks/gpu_actuation.py --layers 4 --hidden 4096 --iterations 40 --json gpu-actuation.json

Read-only, like `gpu_check.py` (which runs this as its `actuation` section): every pynvml write is
blocked before anything runs, and the controller runs in dry-run. A few transformer blocks run
forward and a real backward (input AND weight gradients, as training computes them), one
computation per block, with the runtime's sequencer and a dry-run controller attached the way the
runtime attaches them. It reports:

* the hook alone on the training thread per computation: the sequencer's two calls around it
  (CUDA event records + the queued clock request), NOT the block's kernel launches or autograd;
  split into the event records and the rest (the request); median, p99;
* beside it, in the same place, a bare `torch.cuda.Event(enable_timing=True).record()` (two per
  computation, as the hook records two): what CUDA itself charges for a record right there;
* the same with the host in step with the device (synchronised at each iteration's end, so
  CUDA's launch queue never fills): with the host far ahead, any launch -- an event record too --
  waits for room in the queue, which is backpressure the next kernel launch would pay anyway;
* the same with the host ahead but no controller threads (`quiet`: a stand-in controller that
  only counts requests, no observer): what the worker's and observer's polling of markers
  (interpreter lock, CUDA queries) adds on the training thread;
* then, host still ahead, no perseus-ext at all: just a plain event record where each of the two
  hooks would be (`event_records_only_us`): CUDA's price for the hooks' records in exactly their
  place (the record after the launch is the one that meets a full queue first);
* how far the host leads the device (launch of a computation -> the device starting it);
* how late the controller's observer notices the device reaching an iteration start;
* the clock coverage estimated from the event timestamps and the dry-run's change times, for a
  plan alternating two clocks every two computations, with this GPU's switching latency (the
  set call's own duration included, `SwitchLatency.call_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from gpu_check_support import GuardError, Machine, backward_through, build_blocks, install_nvml_guard, stats  # noqa: E402


class QuietController:
    """A controller without threads: it counts requests and never waits on a marker, so the
    hook's cost with it, against the real controller's, is what the worker's and the observer's
    polling (the interpreter lock, CUDA event queries) adds to the training thread."""

    def __init__(self) -> None:
        from perseus_ext.actuation.issue_delay import IssueDelay

        self.issue_delay = IssueDelay()
        self.requests = 0

    def set_clock(self, mhz: int, at: Any = None, after_s: float = 0.0, by: Any = None) -> None:
        self.requests += 1

    def reset(self, at: Any = None) -> None:
        self.requests += 1


class TimedTimeline:
    """A timeline whose `record_marker` (the CUDA event record) is timed: the hook's share that
    is the event, apart from the sequencer's logic and the queued request."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.record_ns = 0

    def record_marker(self) -> Any:
        began = time.perf_counter_ns()
        marker = self.inner.record_marker()
        self.record_ns += time.perf_counter_ns() - began
        return marker

    def __getattr__(self, name: str) -> Any:  # anchor_at, synchronize, ...
        return getattr(self.inner, name)


def measure_actuation(machine: Machine, gpu: Any, *, layers: int, hidden: int, sequence: int, batch: int,
                      iterations: int, in_step_iterations: int, deadline: float,
                      quiet_iterations: int = 10, records_only_iterations: int = 10) -> dict[str, Any]:
    """Run `iterations` with the host ahead, then `quiet_iterations` with the host ahead and no
    controller threads, `records_only_iterations` with plain event records in the hooks' place,
    then `in_step_iterations` synchronised at their end."""
    torch = machine.torch
    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.actuation.sequencer import ClockSequencer
    from perseus_ext.measurement.coverage import estimate_coverage
    from perseus_ext.measurement.gpu import gpu_switch_latency

    latency = gpu_switch_latency(gpu)
    clocks = gpu.supported_sm_clocks()
    plan_clocks = (clocks[0], clocks[len(clocks) // 3])
    blocks = build_blocks(machine, layers, hidden)
    data = torch.randn(batch, sequence, hidden, device=machine.device, dtype=machine.dtype)
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    timeline = TimedTimeline(machine.timeline())
    sequencer = ClockSequencer(controller, timeline, latency=latency)
    quiet_sequencer = ClockSequencer(QuietController(), timeline, latency=latency)
    computations = 2 * layers
    plan = tuple(plan_clocks[(k // 2) % 2] for k in range(computations))
    phases = {name: {"hook": [], "record": [], "bare": [], "traces": []} for name in ("ahead", "quiet", "records_only", "in_step")}
    Event = machine.cuda.Event
    bare_events: list[Any] = []  # the bare records' events, dropped at the next iteration start
    start_hook_us: list[float] = []

    def hooked(phase: dict[str, list], sequencer: ClockSequencer, launches: list[float], launch: Any) -> Any:
        """One computation between the sequencer's two hooks; the hooks alone are timed (and,
        within them, the event records: the block's launches record none), and so is a bare
        event record just before the first hook and just after the second."""
        b0 = time.perf_counter_ns()
        first = Event(enable_timing=True)  # kept, as markers are: no destruction timed
        first.record()
        b1 = time.perf_counter_ns()
        timeline.record_ns = 0
        t0 = time.perf_counter_ns()
        sequencer.computation_started()
        t1 = time.perf_counter_ns()
        launches.append(t1 / 1e9)
        result = launch()
        t2 = time.perf_counter_ns()
        sequencer.computation_finished()
        t3 = time.perf_counter_ns()
        second = Event(enable_timing=True)
        second.record()
        b3 = time.perf_counter_ns()
        bare_events.extend((first, second))
        phase["hook"].append((t1 - t0 + t3 - t2) / 1000.0)
        phase["record"].append(timeline.record_ns / 1000.0)
        phase["bare"].append((b1 - b0 + b3 - t3) / 1000.0)
        return result

    def records_only(phase: dict[str, list], _: Any, launches: list[float], launch: Any) -> Any:
        """One computation between two plain event records where the hooks would be."""
        t0 = time.perf_counter_ns()
        first = Event(enable_timing=True)
        first.record()
        t1 = time.perf_counter_ns()
        launches.append(t1 / 1e9)
        result = launch()
        t2 = time.perf_counter_ns()
        second = Event(enable_timing=True)
        second.record()
        t3 = time.perf_counter_ns()
        bare_events.extend((first, second))
        phase["hook"].append((t1 - t0 + t3 - t2) / 1000.0)
        return result

    durations = None
    iteration = 0
    try:
        quiet_end = iterations + quiet_iterations
        records_end = quiet_end + records_only_iterations
        while iteration < records_end + in_step_iterations and time.perf_counter() < deadline:
            name = ("ahead" if iteration < iterations else "quiet" if iteration < quiet_end
                    else "records_only" if iteration < records_end else "in_step")
            phase = phases[name]
            if iteration == iterations:  # the real controller's worker and observer fall idle
                machine.synchronize()
                controller.flush(10)
            hooks = quiet_sequencer if name == "quiet" else sequencer
            bare_events.clear()
            hook = records_only if name == "records_only" else hooked
            began = time.perf_counter_ns()
            if name != "records_only":
                start = hooks.start_iteration(iteration, plan, durations)
            if name not in ("quiet", "records_only"):
                start_hook_us.append((time.perf_counter_ns() - began) / 1000.0)
                controller.observe(start, iteration)
            launches: list[float] = []
            inputs, outputs = [], []
            current = data
            for block in blocks:  # forward: one computation per block
                current = current.detach().requires_grad_(True)
                out = hook(phase, hooks, launches, lambda: block(current))
                inputs.append(current)
                outputs.append(out)
                current = out
            grad = torch.ones_like(outputs[-1])
            for index in reversed(range(len(outputs))):  # backward: one computation per block
                grad = hook(phase, hooks, launches, lambda: backward_through(
                    machine, blocks[index], outputs[index], inputs[index], grad))
            for block in blocks:
                block.zero_grad(set_to_none=True)
            if name != "records_only":
                phase["traces"].append((hooks.trace, launches))
            if iteration == 1:  # planned durations from a timed iteration, to issue changes ahead
                machine.synchronize()
                durations = tuple(end - begin for begin, end, _ in sequencer.trace.device_spans())
            if iteration >= records_end:
                machine.synchronize()  # in step: the launch queue is empty when the next one starts
            iteration += 1
        machine.synchronize()
        controller.flush(10)
        notices_ms = [1000.0 * (o.noticed_s - o.device_time_s) for o in controller.observations()]
        changes = [(c.issued_s, c.mhz) for c in controller.drain_changes()]
    finally:
        controller.close()
    figures: dict[str, Any] = {
        "iterations": iteration, "computations_per_iteration": computations,
        "model": f"{layers} TransformerEncoderLayer(hidden {hidden}, ffn {4 * hidden}), batch {batch} x sequence "
                 f"{sequence}, {str(machine.dtype).replace('torch.', '')}; backward with weight gradients",
    }
    all_spans = []
    records = phases.pop("records_only")["hook"][2 * computations:]  # the lead builds up again
    figures["event_records_only_us"] = stats(records)
    for name, phase in phases.items():
        host_lead_ms, compute_ms = [], []
        # the host's lead builds up over the first iterations of a phase whose host runs ahead
        for trace, launches in phase["traces"][2 if name != "in_step" else 0:]:
            spans = trace.device_spans() or []
            if name == "ahead":
                all_spans.extend(spans)
            compute_ms.extend(1000.0 * (end - begin) for begin, end, _ in spans)
            host_lead_ms.extend(1000.0 * (begin - launched) for (begin, _, _), launched in zip(spans, launches))
        suffix = "" if name == "ahead" else f"_{name}"
        skip = 2 * computations if name == "quiet" else 0  # as its traces: the lead builds up again
        hook, record, bare = (phase[key][skip:] for key in ("hook", "record", "bare"))
        request_us = [h - r for h, r in zip(hook, record)]
        figures.update({f"hook_us{suffix}": stats(hook), f"hook_event_records_us{suffix}": stats(record),
                        f"hook_request_us{suffix}": stats(request_us), f"bare_event_records_us{suffix}": stats(bare),
                        f"host_lead_ms{suffix}": stats(host_lead_ms), f"computation_ms{suffix}": stats(compute_ms)})
    tally = estimate_coverage(all_spans, changes, latency, None, default_clock_mhz=clocks[0])
    figures.update({
        "iteration_start_hook_us": stats(start_hook_us), "notice_delay_ms": stats(notices_ms),
        "call_latency_ms": 1000.0 * latency.call_s, "switch_latency_ms": 1000.0 * latency.switch_s,
        "transition_ms": 1000.0 * latency.transition_s, "clock_changes": len(changes),
        "estimated_coverage": tally.coverage,
    })
    return figures


def main() -> int:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--layers", type=bounded_int(1, 10**9), default=4, help="transformer blocks (one computation each)")
    parser.add_argument("--hidden", type=bounded_int(1, 10**9), default=4096)
    parser.add_argument("--sequence", type=bounded_int(1, 10**9), default=1024)
    parser.add_argument("--batch", type=bounded_int(1, 10**9), default=4)
    parser.add_argument("--iterations", type=bounded_int(1, 10**9), default=40, help="iterations with the host ahead")
    parser.add_argument("--quiet-iterations", type=bounded_int(0, 10**9), default=10, help="iterations ahead without controller threads")
    parser.add_argument("--records-only-iterations", type=bounded_int(0, 10**9), default=10,
                        help="iterations ahead with plain event records in the hooks' place")
    parser.add_argument("--in-step-iterations", type=bounded_int(0, 10**9), default=10, help="iterations synchronised at their end")
    parser.add_argument("--output", "--json", dest="json", help="also write the figures to this file")
    args = parser.parse_args()

    import pynvml

    install_nvml_guard(pynvml, [])  # read-only: before perseus-ext can touch NVML
    try:
        pynvml.nvmlDeviceSetGpuLockedClocks(None, 1, 1)
        print("the NVML write guard does not hold; refusing to run", file=sys.stderr)
        return 2
    except GuardError:
        pass
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    torch.cuda.init()
    from perseus_ext.measurement.gpu import open_gpu

    figures = measure_actuation(Machine(cpu=False), open_gpu("nvml"), layers=args.layers, hidden=args.hidden,
                                sequence=args.sequence, batch=args.batch, iterations=args.iterations,
                                in_step_iterations=args.in_step_iterations, quiet_iterations=args.quiet_iterations,
                                records_only_iterations=args.records_only_iterations,
                                deadline=time.perf_counter() + 600)
    for key, value in figures.items():
        print(f"{key:<30} {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
