"""`pip install -e .` without extras must give a working CLI: no torch, DeepSpeed or Megatron.

Each check runs in a fresh interpreter in which importing those frameworks fails, as on a
machine where only the core requirements (numpy, scipy, networkx, tqdm) are installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

FRAMEWORKS = ("torch", "deepspeed", "megatron", "pynvml", "matplotlib")


def _run_without_frameworks(code: str) -> subprocess.CompletedProcess:
    blocker = textwrap.dedent(
        f"""
        import sys
        for name in {FRAMEWORKS!r}:
            sys.modules[name] = None  # `import name` now raises ImportError
        """
    )
    return subprocess.run(
        [sys.executable, "-c", blocker + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_needs_no_framework() -> None:
    result = _run_without_frameworks(
        """
        from perseus_ext.cli import main
        try:
            main(["--help"])
        except SystemExit as done:
            sys.exit(done.code)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "usage: perseus-ext" in result.stdout


def test_every_subcommand_help_needs_no_framework() -> None:
    result = _run_without_frameworks(
        """
        import argparse
        from perseus_ext.cli import build_parser
        parser = build_parser()
        (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands = subcommands.choices
        for name in commands:
            try:
                parser.parse_args([name, "--help"])
            except SystemExit as done:
                assert done.code == 0, name
        print("checked", sorted(commands))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "checked" in result.stdout
