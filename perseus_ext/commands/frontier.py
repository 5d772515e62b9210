"""`perseus-ext frontier`: compute a pipeline's iteration time–energy frontier from a profile."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from perseus_ext.commands.options import (
    add_blocking_power_argument,
    add_output_argument,
    add_profile_argument,
    blocking_power_w,
    bounded_float,
    bounded_int,
    check_pipeline_size,
    check_plotting,
    check_writable_file,
    resolve_profile,
)

MAX_STAGES = 256
MAX_MICROBATCHES = 4096
MAX_VIRTUAL_STAGES = 64
MIN_RESOLUTION_S, MAX_RESOLUTION_S = 1e-4, 60.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "frontier",
        help="compute the iteration time-energy frontier of a pipeline from a profile",
        description="Compute every Pareto-optimal (iteration time, energy) plan of a pipeline, "
        "from all-max-clock speed to the minimum-energy plan, and write it as JSON.",
    )
    add_profile_argument(parser)
    parser.add_argument("--stages", type=bounded_int(1, MAX_STAGES),
                        help="pipeline stages (default: the profile's)")
    parser.add_argument("--microbatches", type=bounded_int(1, MAX_MICROBATCHES), required=True,
                        help="microbatches per iteration")
    add_blocking_power_argument(parser)
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b",
                        help="pipeline schedule (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=bounded_int(1, MAX_VIRTUAL_STAGES), default=1,
                        help="model chunks per stage (interleaved schedule; default: %(default)s)")
    parser.add_argument("--resolution", type=bounded_float(MIN_RESOLUTION_S, MAX_RESOLUTION_S),
                        default=1e-3, help="max time step between plans in seconds (default: %(default)s)")
    parser.add_argument("--switch-latency", type=bounded_float(0.0, 10.0), default=0.0,
                        help="effective clock-change latency in seconds: plans pay for it and avoid changes "
                             "not worth it (default: %(default)s)")
    parser.add_argument("--wait-aware", action="store_true",
                        help="also the plans for an iteration held to a longer time anyway (a straggler): "
                             "cheapest in energy - blocking power x stages x time, up to the all-slowest plan")
    add_output_argument(parser, help="write the frontier JSON here", old=("--out",))
    parser.add_argument("--plot", type=Path, help="write a frontier plot here (.png, .svg or .pdf)")
    parser.set_defaults(func=run, exit_at_once=True)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before the solve if an output cannot be written."""
    if args.output:
        check_writable_file(args.output, "--output")
    if args.plot:
        check_plotting(args.plot, "--plot")
        check_writable_file(args.plot, "--plot")


def run(args: argparse.Namespace) -> int:
    # The solver's numpy work is elementwise: OpenBLAS's thread pool would only add ~60 ms of
    # CPU to the command's start-up (a user's own setting is kept).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from perseus_ext.planning.profile import load_profile, useful_indices
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.planning.solver import SolverOptions, solve_frontier

    path = resolve_profile(args.profile)
    profile = load_profile(path)
    power = blocking_power_w(args.blocking_power, path)
    stages = args.stages if args.stages is not None else profile.num_stages
    check_pipeline_size(stages, args.microbatches, args.virtual_stages)
    schedule = build_schedule(args.schedule, stages, args.microbatches, args.virtual_stages)
    check_outputs(args)
    started = time.perf_counter()
    frontier = solve_frontier(
        schedule, profile, power,
        SolverOptions(resolution=args.resolution, progress=sys.stderr.isatty()),
        switch_latency_s=args.switch_latency, wait_aware=args.wait_aware,
    )
    elapsed = time.perf_counter() - started
    if args.output:
        frontier.save(args.output)
    if args.plot:
        from perseus_ext.observability.plotting import plot_frontier

        plot_frontier(frontier, args.plot)

    fast, cheapest, base = frontier.fastest, frontier.min_energy, frontier.baseline
    print(f"profile        {path.name} ({profile.num_stages} stages), blocking power {power:g} W")
    measured = sum(len(op) for op in profile.points.values())
    useful = sum(len(useful_indices(op.times, op.energies, power)) for op in profile.points.values())
    print(f"useful clocks  {useful} of {measured} measured (dropped: another clock of the same "
          f"computation no slower and no costlier in energy - {power:g} W x time)")
    print(f"schedule       {schedule.kind.value}, {stages} stages x {args.microbatches} microbatches"
          + (f" x {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else ""))
    ordinary = len(frontier.ordinary_plans)
    print(f"solved in      {elapsed:.2f} s: {ordinary} plans"
          + (f" + {len(frontier.plans) - ordinary} wait-aware" if ordinary < len(frontier.plans) else ""))
    print(f"all max clock  T = {base.time:.4f} s, energy {base.energy:,.1f} J")
    print(f"T_min          T = {fast.time:.4f} s, energy {fast.energy:,.1f} J "
          f"(intrinsic saving {frontier.intrinsic_saving():.2%} at no slowdown)")
    print(f"T* (min energy) T = {cheapest.time:.4f} s, energy {cheapest.energy:,.1f} J "
          f"({1 - cheapest.energy / base.energy:.2%} less, {cheapest.time / base.time - 1:+.2%} time)")
    if args.output:
        print(f"wrote          {args.output}")
    if args.plot:
        print(f"plotted        {args.plot}")
    sys.stdout.flush()
    return 0
