"""`perseus-ext report LOG_OR_DIR...`: the job's measured saving from the runtime's JSONL logs
(perseus.log_path), every rank's own saving beside it, and what warm-up, profiling and solving
cost; the analysis itself is `perseus_ext.observability.reporting`.

Example: with "log_path": "logs/perseus-{rank}.jsonl" in the job's perseus section,

    perseus-ext report logs --plot timeline.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from perseus_ext.commands.arguments import add_output_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="the job's measured saving from the runtime's JSONL logs (every rank's)",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="example: perseus-ext report logs --plot timeline.png  (logs/: where perseus.log_path "
               "'logs/perseus-{rank}.jsonl' writes)",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG_OR_DIR",
                        help="JSONL logs written to perseus.log_path, one per rank, or the folder holding them "
                             "(its *.jsonl files)")
    parser.add_argument("--frontier", metavar="JSON", help="frontier file (perseus.frontier_path): print the "
                        "model's saving beside the measured one")
    parser.add_argument("--job", metavar="ID", help="report this job (the logs' 'job' field) when the logs hold "
                        "several; default: the job of the logs' latest runs")
    add_output_argument(parser, help="write the timeline figure here", old=("--figure",), metavar="PNG",
                        name="--plot")
    add_output_argument(parser, help="write the analysis as JSON here", old=("--json",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from perseus_ext.commands.arguments import check_plotting, check_writable_file
    from perseus_ext.errors import ConfigError, PerseusError
    from perseus_ext.observability.reporting import analyse, format_report, plot, read_logs

    if args.output:  # before reading logs of any length
        check_writable_file(args.output, "--output")
    if args.plot:
        check_plotting(args.plot, "--plot")
        check_writable_file(args.plot, "--plot")
    model = None
    if args.frontier:
        from perseus_ext.planning.frontier import Frontier

        try:
            model = Frontier.load(args.frontier).intrinsic_saving()
        except PerseusError as err:
            raise ConfigError(f"--frontier {err}") from None
    analysis = analyse(read_logs(args.logs, args.job), model, timeline=bool(args.output or args.plot))
    print(format_report(analysis))
    if args.output:
        Path(args.output).write_text(json.dumps(analysis, indent=2))
    if args.plot:
        print(f"timeline: {plot(analysis, args.plot, title='perseus-ext run: job time and energy per iteration')}")
    return 0
