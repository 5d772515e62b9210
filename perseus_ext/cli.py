"""`perseus-ext` command line: one subcommand per module in `perseus_ext.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Command modules import heavy dependencies inside `func`, so `--help`
stays fast. A user mistake never ends in a traceback: argparse rejects malformed options
(exit 2), a PerseusError (bad profile, config, schedule) is one line on stderr (exit 2), and an
operating-system error while writing results is one line too (exit 1).

The executable (`console`) ends a command that asks for it (`exit_at_once`, set by
`frontier`) with `os._exit` once its output is flushed: tearing the interpreter down frees
every object and module one by one, a tenth of a short `frontier` run (mypy ends its runs
the same way for the same reason). The executable's
process is all perseus-ext's, so it also has glibc keep freed memory for reuse
(`allocator.py`), and a command that exits at once runs without the cyclic garbage
collector (`console`); `main`, which a program may call, leaves both alone.

Only the command named on the command line is registered (its module imported), unless the
line names none (`perseus-ext --help`, a mistyped command): the other parsers would cost a
short `frontier` run a few milliseconds.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from perseus_ext import __version__
from perseus_ext.allocator import keep_freed_memory
from perseus_ext.errors import PerseusError

# Each command's name and the module that registers it, in `--help`'s order.
COMMAND_MODULES = {
    "frontier": "perseus_ext.commands.frontier",
    "emulate": "perseus_ext.commands.emulate",
    "batch-size": "perseus_ext.commands.batch_size",
    "demo": "perseus_ext.commands.demo",
    "report": "perseus_ext.commands.report",
    "doctor": "perseus_ext.commands.doctor",
    "patch-path": "perseus_ext.commands.patch_path",
}

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


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with `argv`, the command line it is built for, only of the
    command `argv` names, if it names one (what it parses and says is the same)."""
    parser = argparse.ArgumentParser(
        prog="perseus-ext",
        description="Remove energy bloat from pipeline-parallel training.",
    )
    parser.add_argument("--version", action="version", version=f"perseus-ext {__version__}")
    _add_verbosity(parser, logging.INFO)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = _named_command(argv)
    for name, module in COMMAND_MODULES.items():
        if named in (None, name):
            importlib.import_module(module).register(subparsers)
    for subparser in subparsers.choices.values():
        _add_verbosity(subparser, argparse.SUPPRESS)
    return parser


def _named_command(argv: Sequence[str] | None) -> str | None:
    """The command `argv` names, if it is one of ours: its first word that is not an option
    (the top parser's options, -v/-q/-h/--version, take no value). None when the top parser's
    help comes first (`perseus-ext --help frontier` lists every command)."""
    for word in argv or ():
        if word in ("-h", "--help"):
            return None
        if not word.startswith("-"):
            return word if word in COMMAND_MODULES else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    return run_command(build_parser(argv).parse_args(argv))


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
    for one and left nothing running (its files are closed; here the streams are flushed).

    Such a command also runs with the cyclic garbage collector off: the collector walked the
    heap again and again while numpy and HiGHS were imported and the solver ran (8 x 24: 68
    collections, 8.7 ms of a 0.26 s `frontier` run) and found no cycle but the argument
    parsers' (645 small objects; the solver makes none, and 16 x 128 peaks the same). Every
    other command gets the collector back before it runs (a training demo makes cycles)."""
    gc.disable()
    argv = sys.argv[1:]
    args = build_parser(argv).parse_args(argv)
    if not getattr(args, "exit_at_once", False):
        gc.enable()
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
