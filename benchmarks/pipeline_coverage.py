"""Clock coverage of a two-stage 1F1B pipeline on paced simulated A100s, per stage and per position.

Each stage is a thread with its own simulated device (joined through the cross-rank board, so
stage 1's forwards wait on the device for stage 0's, and stage 0's backwards for stage 1's),
controller and `ClockSequencer`, driving one clock plan as the runtime does. Stage 0 has slack,
so its plan is slower in the middle; its waits for stage 1's backwards are where a ramp can hide.
The table shows the exact coverage per stage and stage 0's uncovered milliseconds per iteration,
for the sequencer with the GPU's latency (issued ahead) and without (each change at
the previous computation's end). Run:

    python benchmarks/pipeline_coverage.py [--iterations 12] [--plan "1410,330,960,...;1410,..."]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perseus_ext.actuation.controller import FrequencyController  # noqa: E402
from perseus_ext.actuation.sequencer import ClockSequencer  # noqa: E402
from perseus_ext.measurement.gpu.sim import SimulatedGPU  # noqa: E402
from perseus_ext.measurement.gpu.timeline_factory import open_timeline  # noqa: E402
from perseus_ext.measurement.gpu.sim.workload import SimulatedWorkloadPacer  # noqa: E402
from perseus_ext.planning.schedule import Kind, build_schedule  # noqa: E402

FORWARD_S, BACKWARD_S = (0.025, 0.035), (0.050, 0.070)  # the demo's stages, at the max clock
DEFAULT_PLAN = "1410,330,960,960,960,960,960,1410;" + ",".join(["1410"] * 8)
WARMUP_ITERATIONS = 2


def run_stage(stage: int, plan: tuple[int, ...], *, job_id: str, ahead: bool, iterations: int,
              out: dict) -> None:
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    gpu = SimulatedGPU("a100_sxm", seed=stage)
    timeline = open_timeline(gpu, job_id=job_id, rank=stage)
    controller = FrequencyController(gpu, watchdog=False, handle_signals=False)
    sequencer = ClockSequencer(controller, timeline, latency=gpu.switch_latency if ahead else None)
    pacer = SimulatedWorkloadPacer(timeline, schedule, stage=stage, pipeline=0, num_pipelines=1,
                                   forward_s=FORWARD_S, backward_s=BACKWARD_S)
    order = schedule.orders[stage]
    work_s = [(FORWARD_S if c.kind is Kind.FORWARD else BACKWARD_S)[stage] for c in order]
    durations = tuple(gpu.expected(w, clock)[0] for w, clock in zip(work_s, plan))
    before = None
    for iteration in range(iterations):
        if iteration == WARMUP_ITERATIONS:
            controller.flush(10)
            timeline.synchronize()
            before = timeline.exact_coverage()
        sequencer.start_iteration(iteration, plan, durations)
        for computation, clock in zip(order, plan):
            pacer.receive(iteration, computation)
            sequencer.computation_started()
            pacer.compute(iteration, computation, clock)
            sequencer.computation_finished()
            time.sleep(0.001)  # the host's own work between launches
        pacer.gradient_sync(iteration)
        timeline.launch("optimizer", 0.010)
    controller.flush(10)
    timeline.synchronize()
    out[stage] = (timeline.exact_coverage() - before, controller)


def measure(plan: list[tuple[int, ...]], *, ahead: bool, iterations: int) -> dict:
    out: dict = {}
    job_id = f"pipeline-coverage-{os.getpid()}-{ahead}"
    threads = [threading.Thread(target=run_stage, args=(stage, plan[stage]),
                                kwargs=dict(job_id=job_id, ahead=ahead, iterations=iterations, out=out))
               for stage in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _, controller in out.values():
        controller.close()
    return out


def main() -> int:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iterations", type=bounded_int(1, 10**9), default=12, help="iterations per run (default 12)")
    parser.add_argument("--plan", default=DEFAULT_PLAN,
                        help="stage 0's clocks;stage 1's clocks, MHz per computation in 1F1B order")
    args = parser.parse_args()
    plan = [tuple(int(c) for c in row.split(",")) for row in args.plan.split(";")]
    counted = args.iterations - WARMUP_ITERATIONS
    print(f"stage 0 plan {list(plan[0])}, stage 1 plan {list(plan[1])}")
    print(f"{'sequencer':>28} {'stage 0':>8} {'stage 1':>8}   uncovered compute per iteration")
    for ahead in (True, False):
        out = measure(plan, ahead=ahead, iterations=args.iterations)
        tallies = [out[stage][0] for stage in range(2)]
        lost = [(tally.planned_s - tally.covered_s) * 1000 / counted for tally in tallies]
        name = "issued ahead (the runtime)" if ahead else "at the previous end"
        print(f"{name:>28} {100 * tallies[0].coverage:7.1f}% {100 * tallies[1].coverage:7.1f}%   "
              f"stage 0 {lost[0]:.1f} ms, stage 1 {lost[1]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
