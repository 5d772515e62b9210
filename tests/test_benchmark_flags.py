"""The benchmark scripts' flags follow the CLI's conventions: a bad value is argparse's usage and
one `error:` line naming the flag, exit status 2 (no traceback, nothing run), and abbreviations are
refused. Each script is run as a user runs it, with the first numeric flag it declares given a
word; the flags are read from the scripts themselves, so a script added later is held to it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The planner's scripts follow the same rules in their own tests.
ELSEWHERE = {"solver.py", "optimality.py", "scale.py", "lp_walk.py", "anchors.py", "latency.py"}


def numeric_flags(script: Path) -> list[str]:
    """The options the script declares with one of the CLI's numeric types."""
    flags = []
    for node in ast.walk(ast.parse(script.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--")):
            kinds = [k.value for k in node.keywords if k.arg == "type"]
            if kinds and isinstance(kinds[0], ast.Call) and getattr(kinds[0].func, "id", "") in ("bounded_int",
                                                                                                  "bounded_float"):
                flags.append(node.args[0].value)
    return flags


SCRIPTS = sorted(path for path in (ROOT / "benchmarks").glob("*.py")
                 if path.name not in ELSEWHERE and "ArgumentParser(" in path.read_text())


def test_every_script_with_flags_uses_the_clis_numeric_types_and_refuses_abbreviations():
    assert len(SCRIPTS) >= 15
    for script in SCRIPTS:
        text = script.read_text()
        assert "type=int" not in text and "type=float" not in text, script.name
        assert text.count("ArgumentParser(") == text.count("allow_abbrev=False"), script.name


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", [s for s in SCRIPTS if numeric_flags(s)], ids=lambda path: path.stem)
def test_a_bad_value_is_one_error_line_and_exit_2(script):
    flag = numeric_flags(script)[0]
    result = subprocess.run([sys.executable, str(script), flag, "many"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0] and "'many' is not" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and result.stderr.lstrip().startswith("usage:"), result.stderr[-2000:]
