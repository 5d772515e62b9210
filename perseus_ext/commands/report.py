"""`perseus-ext report LOG...`: the job's measured saving from the runtime's JSONL logs; the
analysis itself is `perseus_ext.reporting`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="the job's measured saving from the runtime's JSONL logs (every rank's)",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSONL logs written to perseus.log_path, one per rank")
    parser.add_argument("--frontier", metavar="JSON", help="frontier file (perseus.frontier_path): print the "
                        "model's saving beside the measured one")
    parser.add_argument("--job", metavar="ID", help="report this job (the logs' 'job' field) when the logs hold "
                        "several; default: the job of the logs' latest runs")
    parser.add_argument("--figure", metavar="PNG", help="write the timeline figure here")
    parser.add_argument("--json", metavar="PATH", help="write the analysis as JSON here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from perseus_ext.reporting import analyse, format_report, plot, read_logs

    model = None
    if args.frontier:
        from perseus_ext.planning.frontier import Frontier

        model = Frontier.load(args.frontier).intrinsic_saving()
    analysis = analyse(read_logs(args.logs, args.job), model, timeline=bool(args.json or args.figure))
    print(format_report(analysis))
    if args.json:
        Path(args.json).write_text(json.dumps(analysis, indent=2))
    if args.figure:
        print(f"timeline: {plot(analysis, args.figure, title='perseus-ext run: job time and energy per iteration')}")
    return 0
