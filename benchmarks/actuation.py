"""Clock coverage and hook cost: device-ordered actuation against host-timed clock changes.

One stage on a paced simulated A100 (asynchronous device, the host leads it by the launch-queue
depth, 20 ms switch + 10 ms ramp per clock change by default) runs iterations whose
computations alternate between two planned clocks. Two controllers drive the same schedule:

* `device-ahead`: perseus-ext's ClockSequencer as the runtime uses it -- each change is tied to
  a device marker and issued the switching latency ahead of the computation's planned start;
* `device`: the same without issuing ahead -- applied when the device ends the previous
  computation;
* `host`: the old design -- each clock is requested when the host launches the computation
  (what a hook without device ordering does: right for a synchronous device, wrong for CUDA).

Coverage is the share of compute time that ran at its planned clock, exact from the simulated
device. The hook cost is what the training thread pays per computation for the marker and the
queued request (median over all computations), without the simulated launch; a second table
measures it alone on the real-GPU path (host-only markers instead of CUDA events). Run:

    python benchmarks/actuation.py [--durations-ms 10 25 50 100] [--iterations 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perseus_ext.actuation.controller import FrequencyController  # noqa: E402
from perseus_ext.actuation.sequencer import ClockSequencer  # noqa: E402
from perseus_ext.measurement.gpu.sim import SimulatedGPU  # noqa: E402
from perseus_ext.measurement.gpu.cuda_timeline import POLL_S as CUDA_POLL_S  # noqa: E402
from perseus_ext.measurement.gpu.timeline import HostMarker, HostOnlyTimeline  # noqa: E402
from perseus_ext.measurement.gpu.timeline_factory import open_timeline  # noqa: E402

CLOCKS_MHZ = (1050, 1410)


def run(ordering: str, work_s: float, *, iterations: int, computations: int, gap_s: float,
        switch_s: float | None = None, transition_s: float | None = None) -> dict[str, float]:
    """Coverage and per-computation hook cost (µs) of one ordering."""
    ahead = ordering == "device-ahead"
    gpu = SimulatedGPU("a100_sxm", seed=1, switch_s=switch_s, transition_s=transition_s)
    timeline = open_timeline(gpu, job_id=f"bench-{os.getpid()}-{ordering}-{work_s}", rank=0)
    controller = FrequencyController(gpu, watchdog=False, handle_signals=False)
    sequencer = ClockSequencer(controller, timeline, latency=gpu.switch_latency if ahead else None)
    plan = tuple(CLOCKS_MHZ[(k // 2) % 2] for k in range(computations))  # two at each clock
    durations = tuple(gpu.expected(work_s, clock)[0] for clock in plan)
    hook_ns: list[int] = []
    for iteration in range(iterations):
        sequencer.start_iteration(iteration, plan if ordering != "host" else None, durations)
        for position in range(computations):
            time.sleep(gap_s)  # the host's own work between launches (framework, receives)
            started = time.perf_counter_ns()
            if ordering != "host":
                sequencer.computation_started()
            else:
                controller.set_clock(plan[position])
            hook_ns.append(time.perf_counter_ns() - started)
            timeline.launch("forward", work_s, planned_clock_mhz=plan[position])
            started = time.perf_counter_ns()
            if ordering != "host":
                sequencer.computation_finished()
            hook_ns[-1] += time.perf_counter_ns() - started
    timeline.synchronize()
    tally = timeline.exact_coverage()
    controller.close()
    timeline.close()
    return {"coverage": tally.coverage, "hook_us": statistics.median(hook_ns) / 1000.0}


class LaggingMarker(HostMarker):
    """Reached `lag_s` after it was recorded, as a CUDA event is once the device, behind the
    host, has run the work launched before it."""

    def query(self) -> bool:
        return time.perf_counter() >= self._at_s

    def wait(self, timeout_s: float | None = None) -> bool:
        """Polls like `CudaMarker.wait` with a timeout (each query takes the GIL)."""
        deadline = time.perf_counter() + (timeout_s if timeout_s is not None else float("inf"))
        while not self.query():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(CUDA_POLL_S)
        return True

    def device_time_s(self) -> float | None:
        return self._at_s if self.query() else None


class LaggingTimeline(HostOnlyTimeline):
    """Markers the device reaches `lag_s` after the host records them (the host leads)."""

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s

    def record_marker(self) -> LaggingMarker:
        return LaggingMarker(time.perf_counter() + self.lag_s)


def hook_cost(plan: tuple[int, ...], iterations: int = 300, device_lag_s: float = 0.0) -> tuple[float, float]:
    """Median and p99 µs the training thread pays per computation (both hooks) on the real-GPU
    path: host-only markers, or markers reached `device_lag_s` after they are recorded (a CUDA
    event record adds its own few µs on a GPU)."""
    gpu = SimulatedGPU("a100_sxm", seed=1)
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    timeline = LaggingTimeline(device_lag_s) if device_lag_s > 0 else HostOnlyTimeline()
    sequencer = ClockSequencer(controller, timeline, latency=gpu.switch_latency)
    durations = tuple(0.01 for _ in plan)
    costs = []
    for iteration in range(iterations):
        sequencer.start_iteration(iteration, plan, durations)
        for _ in plan:
            started = time.perf_counter_ns()
            sequencer.computation_started()
            sequencer.computation_finished()
            costs.append(time.perf_counter_ns() - started)
            time.sleep(0.0002)  # the framework's own work between hooks
    controller.close()
    costs.sort()
    return costs[len(costs) // 2] / 1000.0, costs[int(0.99 * len(costs))] / 1000.0


def main() -> int:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--durations-ms", type=bounded_float(0.0, 1e9, inclusive_min=False), nargs="+", default=[10.0, 25.0, 50.0, 100.0])
    parser.add_argument("--iterations", type=bounded_int(1, 10**9), default=6)
    parser.add_argument("--computations", type=bounded_int(1, 10**9), default=8)
    parser.add_argument("--gap-ms", type=bounded_float(0.0, 1e9), default=1.0, help="host work between launches")
    args = parser.parse_args()
    print("# one stage, paced simulated A100 (switch 20 ms + ramp 10 ms), host leads by the launch "
          f"queue; {args.iterations} iterations x {args.computations} computations, clocks "
          f"alternate every 2 computations between {CLOCKS_MHZ[0]} and {CLOCKS_MHZ[1]} MHz")
    orderings = ("device-ahead", "device", "host")
    print(f"{'computation':>12}" + "".join(f"{'coverage ' + o:>22}" for o in orderings)
          + "".join(f"{'hook us ' + o:>21}" for o in orderings))
    for duration_ms in args.durations_ms:
        results = {ordering: run(ordering, duration_ms / 1000.0, iterations=args.iterations,
                                 computations=args.computations, gap_s=args.gap_ms / 1000.0)
                   for ordering in orderings}
        print(f"{duration_ms:>9.0f} ms" + "".join(f"{100 * results[o]['coverage']:>21.1f}%" for o in orderings)
              + "".join(f"{results[o]['hook_us']:>21.2f}" for o in orderings))
    print()
    print("# training-thread cost per computation (both hooks), dry-run controller; markers reached when "
          "recorded (no device), or 10 ms later (a host that leads its GPU, as with CUDA events)")
    for label, plan in (("one clock change per iteration", (1050,) * 12 + (1410,) * 4),
                        ("a clock change at every computation", (1410, 1050) * 8)):
        for lag_s in (0.0, 0.01):
            median, p99 = hook_cost(plan, device_lag_s=lag_s)
            markers = "host-only markers" if lag_s == 0 else f"device {1000 * lag_s:.0f} ms behind"
            print(f"{label:<38} {markers:<22} median {median:6.2f} us   p99 {p99:6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
