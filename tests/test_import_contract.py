"""The import contract (pyproject.toml's [tool.importlinter], docs/ARCHITECTURE.md): rooms import
downwards only, no package has an import cycle, and planning never imports torch. import-linter
checks it on the source tree; a copy of the package with one wrong-way import proves the check
would catch it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the `perseus_ext` under `root`, with this repository's contract."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_source_keeps_the_import_contract():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_a_wrong_way_import_and_a_cycle_break_the_contract(tmp_path):
    shutil.copytree(REPO / "perseus_ext", tmp_path / "perseus_ext",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pth"))
    profile = tmp_path / "perseus_ext" / "planning" / "profile.py"
    profile.write_text(profile.read_text() + "\nfrom perseus_ext.runtime import config  # noqa: E402,F401\n")
    schedule = tmp_path / "perseus_ext" / "planning" / "schedule.py"
    schedule.write_text(schedule.read_text() + "\nfrom perseus_ext.planning import solver  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "perseus_ext.planning is not allowed to import perseus_ext.runtime" in result.stdout
    assert "No cycles are allowed in perseus_ext.planning" in result.stdout
