"""Cost of FrequencyController.set_clock() as seen by the training thread.

The hook runs before every forward/backward, so it must stay in the microseconds: it only puts
the target on a queue; the worker thread talks to the GPU. Run:

    python benchmarks/controller_hook.py [--calls 20000] [--gpu sim:a100_sxm]

Prints median / p99 / mean wall cost per call (perf_counter_ns around each call; the timer's own
cost is measured and reported separately, not subtracted). With `--gpu nvml` the controller runs
in dry-run mode (nothing is changed on the GPU) unless --live is given.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perseus_ext.actuation.controller import FrequencyController  # noqa: E402
from perseus_ext.measurement.gpu import open_gpu  # noqa: E402


def _percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def measure(controller: FrequencyController, clocks: list[int], calls: int, pace_s: float) -> list[int]:
    """Per-call cost in ns; `pace_s` spaces calls out like computations do (0 = back to back)."""
    costs = []
    timer = time.perf_counter_ns
    set_clock = controller.set_clock
    for index in range(calls):
        mhz = clocks[index % len(clocks)]
        start = timer()
        set_clock(mhz)
        costs.append(timer() - start)
        if pace_s:
            deadline = time.perf_counter() + pace_s
            while time.perf_counter() < deadline:  # busy-wait: sleep granularity is too coarse
                pass
    controller.flush(30)
    return costs


def timer_overhead(calls: int) -> list[int]:
    timer = time.perf_counter_ns
    costs = []
    for _ in range(calls):
        start = timer()
        costs.append(timer() - start)
    return costs


def main() -> int:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calls", type=bounded_int(1, 10**9), default=20000)
    parser.add_argument("--gpu", default="sim:a100_sxm?pace=0", help="open_gpu spec")
    parser.add_argument("--live", action="store_true", help="really set clocks on an NVML GPU")
    args = parser.parse_args()

    gpu = open_gpu(args.gpu)
    clocks = gpu.supported_sm_clocks()[:: max(1, len(gpu.supported_sm_clocks()) // 8)]
    dry = args.gpu.startswith("nvml") and not args.live
    rows = [("perf_counter_ns() pair (timer overhead)", timer_overhead(args.calls))]
    scenarios = [
        ("dry-run (records the clock)", True, clocks, 0.0),
        ("same clock again (duplicate skipped)", dry, clocks[:1], 0.0),
        ("new clock, back to back (enqueue)", dry, clocks, 0.0),
        ("new clock, every 200 us (worker idle)", dry, clocks, 200e-6),
    ]
    for title, dry_run, sequence, pace in scenarios:
        controller = FrequencyController(gpu, dry_run=dry_run, watchdog=False, handle_signals=False)
        costs = measure(controller, sequence, args.calls, pace)
        controller.close()
        rows.append((title, costs))

    print(f"# FrequencyController.set_clock() cost, {args.calls} calls, GPU {gpu.name}")
    print(f"# python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'scenario':<42} {'median us':>10} {'p99 us':>10} {'mean us':>10}")
    for title, costs in rows:
        ordered = sorted(costs)
        print(
            f"{title:<42} {_percentile(ordered, 0.5):>10.2f} {_percentile(ordered, 0.99):>10.2f} "
            f"{statistics.fmean(costs) / 1000:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
