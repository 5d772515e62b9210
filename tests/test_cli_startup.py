"""The executable's start-up: only the named command's parser is built, and a command that
exits at once runs without the cyclic garbage collector (`cli.py` says why)."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import pytest

from perseus_ext import cli
from perseus_ext.cli import COMMAND_MODULES, build_parser


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


LINES = [
    ["frontier", "--profile", "gpt3-175b-a40", "--microbatches", "4", "--out", "f.json"],
    ["-q", "emulate", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "4"],
    ["-v", "patch-path"],
    ["doctor", "-q"],
]


@pytest.mark.parametrize("argv", LINES, ids=lambda argv: " ".join(argv))
def test_a_line_that_names_a_command_builds_only_its_parser_and_parses_the_same(argv) -> None:
    named = next(word for word in argv if not word.startswith("-"))
    parser = build_parser(argv)
    assert _commands(parser) == [named]
    assert vars(parser.parse_args(argv)) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv", [[], ["--help"], ["-q", "-h", "frontier"], ["--version"], ["frontiers", "--microbatches", "4"]])
def test_a_line_that_names_no_command_gets_every_parser(argv) -> None:
    assert _commands(build_parser(argv)) == list(COMMAND_MODULES)


def test_the_top_help_lists_every_command_even_before_one(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help", "frontier"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMAND_MODULES)


def test_a_mistyped_command_is_told_every_command(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["frontiers", "--microbatches", "4"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frontiers'" in err and all(name in err for name in COMMAND_MODULES)


@pytest.mark.parametrize("argv, collector_on", [
    (["frontier", "--profile", "gpt3-175b-a40", "--microbatches", "2"], False),  # exits at once
    (["patch-path"], True),
    (["doctor"], True),
])
def test_only_a_command_that_exits_at_once_runs_without_the_collector(argv, collector_on, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: True)
    monkeypatch.setattr(cli, "run_command", lambda args: seen.append(gc.isenabled()) or 0)
    monkeypatch.setattr(cli.os, "_exit", sys.exit)  # a frontier run ends with os._exit
    monkeypatch.setattr(sys, "argv", ["perseus-ext", *argv])
    try:
        with pytest.raises(SystemExit):
            cli.console()
    finally:
        gc.enable()
    assert seen == [collector_on]


def test_main_leaves_the_collector_alone(tmp_path: Path) -> None:
    assert gc.isenabled()
    cli.main(["frontier", "-q", "--profile", "gpt3-175b-a40", "--microbatches", "2", "--out", str(tmp_path / "f.json")])
    assert gc.isenabled()
