"""The import contract (pyproject.toml's [tool.importlinter], docs/ARCHITECTURE.md): rooms import
downwards only (observability below the runtime, so `perseus-ext report` never loads it), no
package has an import cycle, the config room imports no framework, numpy or database driver,
only the GPU door and the simulated workload's pacer name the simulator, and planning never
imports torch. import-linter checks it on the source tree; a
copy of the package with wrong-way imports proves the check would catch them."""

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
    assert "5 kept, 0 broken" in result.stdout


def test_a_wrong_way_import_and_a_cycle_break_the_contract(tmp_path):
    shutil.copytree(REPO / "perseus_ext", tmp_path / "perseus_ext",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pth"))
    profile = tmp_path / "perseus_ext" / "planning" / "profile.py"
    profile.write_text(profile.read_text() + "\nfrom perseus_ext.runtime import wiring  # noqa: E402,F401\n")
    schedule = tmp_path / "perseus_ext" / "planning" / "schedule.py"
    schedule.write_text(schedule.read_text() + "\nfrom perseus_ext.planning import solver  # noqa: E402,F401\n")
    log_files = tmp_path / "perseus_ext" / "observability" / "log_files.py"  # the report must not need the runtime
    log_files.write_text(log_files.read_text() + "\nfrom perseus_ext.runtime import recorder  # noqa: E402,F401\n")
    gpu_spec = tmp_path / "perseus_ext" / "config" / "gpu.py"
    gpu_spec.write_text(gpu_spec.read_text() + "\nimport sqlalchemy  # noqa: E402,F401\n")
    controller = tmp_path / "perseus_ext" / "actuation" / "controller.py"  # real GPUs must not load the simulator
    controller.write_text(controller.read_text()
                          + "\nfrom perseus_ext.measurement.gpu.sim import SimulatedGPU  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "perseus_ext.config is not allowed to import sqlalchemy" in result.stdout
    assert "perseus_ext.config.gpu -> sqlalchemy" in result.stdout
    assert "perseus_ext.planning is not allowed to import perseus_ext.runtime" in result.stdout
    assert "perseus_ext.observability is not allowed to import perseus_ext.runtime" in result.stdout
    assert "No cycles are allowed in perseus_ext.planning" in result.stdout
    assert "perseus_ext.actuation.controller -> perseus_ext.measurement.gpu.sim" in result.stdout
