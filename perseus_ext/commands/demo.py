"""`perseus-ext demo`: the whole Perseus loop inside DeepSpeed on CPU with simulated GPUs.

It launches a real DeepSpeed pipeline job with torchrun (gloo, one process per simulated A100):
2 stages x 2 data-parallel pipelines by default. The same training runs twice from the same seed, side by side
(one iteration each in turn, so machine noise hits both alike): once with perseus-ext only
observing (default clocks: the baseline), once optimising. Midway,
one pipeline's GPUs slow down by 1.2x (a straggler) and later recover. The command prints
baseline vs perseus time and energy per iteration, splits the savings into intrinsic (fastest
plan, no straggler) and extrinsic (slower plans while another pipeline straggles), and draws
the frontier and a timeline. Beside the side-by-side figure it prints what a real job, which has
no twin, reports: the saving measured against its own baseline probes (`perseus-ext report` on
the perseus run's logs), with its confidence interval.

The job itself is `perseus_ext.demo` (scenario, torchrun worker, analysis, report), which the
DeepSpeed end-to-end tests also use with other scenarios.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from perseus_ext.commands.arguments import add_output_argument, bounded_float, bounded_int

MAX_RANKS = 32  # processes the demo starts on one machine (stages x pipelines)
DEFAULT_OUTPUT = "perseus-demo"  # run from a checkout, README's command writes there: .gitignore lists it


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the Perseus loop inside DeepSpeed on CPU with simulated GPUs",
        description=__doc__.split("\n\n")[0],
    )
    add_output_argument(parser, help="output folder, relative to the current one (default: %(default)s; "
                        "a perseus-ext checkout's .gitignore ignores it there)", old=("--out",), metavar="DIR",
                        default=Path(DEFAULT_OUTPUT))
    parser.add_argument("--stages", type=bounded_int(2, MAX_RANKS), default=2,
                        help="pipeline stages (default: %(default)s)")
    parser.add_argument("--pipelines", type=bounded_int(1, MAX_RANKS // 2), default=2,
                        help="data-parallel pipelines; pipeline 1 straggles midway (default: %(default)s)")
    parser.add_argument("--microbatches", type=bounded_int(1, 256), default=4,
                        help="microbatches per iteration (default: %(default)s)")
    parser.add_argument("--iterations", type=bounded_int(40, 100_000), default=48,
                        help="training iterations per run, at least 40 to leave room for profiling and a "
                             "straggler (default: %(default)s)")
    parser.add_argument("--slowdown", type=bounded_float(1.0, 100.0), default=1.2,
                        help="straggler slowdown factor (default: %(default)s)")
    parser.add_argument("--straggler-check-interval", type=bounded_int(1, 1000), default=2,
                        help="iterations between straggler checks, perseus.straggler_check_interval "
                             "(default: %(default)s)")
    parser.add_argument("--timeout", type=bounded_float(1.0, 7 * 86400.0), default=600.0,
                        help="seconds before the job is killed")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from perseus_ext.demo import Scenario, compare, launch, plot, print_report
    from perseus_ext.demo.report import finish_line, launch_line
    from perseus_ext.errors import ConfigError

    from perseus_ext.commands.arguments import check_writable_dir

    if args.stages * args.pipelines > MAX_RANKS:
        raise ConfigError(f"--stages {args.stages} x --pipelines {args.pipelines} is {args.stages * args.pipelines} "
                          f"processes; the demo starts at most {MAX_RANKS} on one machine: lower either")
    check_writable_dir(Path(args.output), "--output")
    # Forwards of 12-17 ms (backwards twice that), a quarter to a third of the published GPT-3
    # 175B per-stage forward time (~50 ms on an A100): long enough that most of a clock change
    # (25 ms to land) hides in the waits around a computation, short enough that the whole demo
    # (two runs side by side, profiling included) takes about a minute on an idle 2-core machine.
    # The clocks are searched in 135 MHz steps (clock_stride 9: 9 clocks, 1410-330 MHz).
    forward = [0.012 + 0.0048 * s / (args.stages - 1) for s in range(args.stages)]
    scenario = Scenario(
        out_dir=str(args.output), stages=args.stages, pipelines=args.pipelines,
        microbatches=args.microbatches, iterations=args.iterations,
        forward_seconds=forward, backward_seconds=[2 * f for f in forward],
        straggler_pipeline=1 if args.pipelines > 1 else None,
        # The straggler leaves over 40 % of the run to recover in, so the few iterations the
        # others need to notice (two checks) stay a minority of the "recovered" window.
        straggler_start=int(args.iterations * 0.42), straggler_end=int(args.iterations * 0.69),
        slowdown=args.slowdown,
        perseus={"clock_stride": 9, "straggler_check_interval": args.straggler_check_interval},
    )
    print(launch_line(scenario))
    results = launch(scenario, timeout_s=args.timeout)
    comparison = compare(scenario, results)
    print_report(scenario, comparison, results)
    paths = plot(scenario, comparison, results)
    (Path(args.output) / "comparison.json").write_text(json.dumps(comparison["windows"], indent=2))
    print()
    print(finish_line(paths, time.perf_counter() - started))
    return 0
