"""`perseus-ext` command line: one subcommand per module in `perseus_ext.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Command modules import heavy dependencies inside `func`, so `--help`
stays fast. A user mistake never ends in a traceback: argparse rejects malformed options
(exit 2), a PerseusError (bad profile, config, schedule) is one line on stderr (exit 2), and an
operating-system error while writing results is one line too (exit 1).

The executable (`console`) ends a command that asks for it (`exit_at_once`, set by
`frontier`) with `os._exit` once its output is flushed: tearing the interpreter down frees
every object and module one by one, 30-60 ms of a ~0.5 s `frontier` run on this project's
2-core machine (mypy ends its runs the same way for the same reason). The executable's
process is all perseus-ext's, so it also has glibc keep freed memory for reuse
(`allocator.py`); `main`, which a program may call, leaves the allocator alone.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from typing import NoReturn

from perseus_ext import __version__
from perseus_ext.allocator import keep_freed_memory
from perseus_ext.errors import PerseusError

COMMAND_MODULES = [
    "perseus_ext.commands.frontier",
    "perseus_ext.commands.emulate",
    "perseus_ext.commands.batch_size",
    "perseus_ext.commands.demo",
    "perseus_ext.commands.report",
    "perseus_ext.commands.doctor",
    "perseus_ext.commands.patch_path",
]

EXIT_USAGE = 2  # argparse's own code for a bad command line
EXIT_FAILURE = 1


def _add_verbosity(parser: argparse.ArgumentParser, default: object) -> None:
    """-v/-q on the top parser and on every subcommand (`perseus-ext frontier -q ...`); the
    subcommands' default is SUPPRESS so they never reset what the top parser set."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG,
                       default=default, help="log debug details (e.g. every dropped profile clock)")
    group.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING,
                       default=default, help="log only warnings and errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perseus-ext",
        description="Remove energy bloat from pipeline-parallel training.",
    )
    parser.add_argument("--version", action="version", version=f"perseus-ext {__version__}")
    _add_verbosity(parser, logging.INFO)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for subparser in subparsers.choices.values():
        _add_verbosity(subparser, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code."""
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("perseus_ext").setLevel(args.log_level)  # also when logging was set up before
    try:
        return int(args.func(args) or 0)
    except PerseusError as err:
        print(f"perseus-ext {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print(f"perseus-ext {args.command}: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"perseus-ext {args.command}: interrupted", file=sys.stderr)
        return 130


def console() -> NoReturn:
    """The `perseus-ext` executable: `main`, then an immediate exit for a command that asks
    for one and left nothing running (its files are closed; here the streams are flushed)."""
    args = build_parser().parse_args()
    keep_freed_memory()
    code = run_command(args)
    if getattr(args, "exit_at_once", False) and threading.active_count() == 1:
        logging.shutdown()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: what it lost cannot be written anywhere
            code = code or EXIT_FAILURE
        os._exit(code)
    sys.exit(code)
