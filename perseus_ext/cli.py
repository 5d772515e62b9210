"""`perseus-ext` command line: one subcommand per module in `perseus_ext.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Command modules import heavy dependencies inside `func`, so `--help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from perseus_ext import __version__
from perseus_ext.errors import PerseusError

COMMAND_MODULES = [
    "perseus_ext.commands.frontier",
    "perseus_ext.commands.emulate",
    "perseus_ext.commands.batch_size",
    "perseus_ext.commands.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perseus-ext",
        description="Remove energy bloat from pipeline-parallel training.",
    )
    parser.add_argument("--version", action="version", version=f"perseus-ext {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except PerseusError as err:
        print(f"perseus-ext {args.command}: error: {err}", file=sys.stderr)
        return 2
