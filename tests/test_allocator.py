"""The executable and the background solver have glibc keep freed memory for reuse."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from perseus_ext import cli

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")

# Twelve 1 MiB arrays made and dropped, as the solver's blocked passes do: glibc's default
# (dynamic) trim threshold hands the freed heap top back, and the next round faults it in again.
CHURN = """
import resource, sys
import numpy as np
from perseus_ext.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def churn():
    for _ in range(20):
        arrays = [np.ones(2**17) for _ in range(12)]
        del arrays
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults_of_churn(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@glibc_only
def test_freed_arrays_are_reused_without_faulting_their_pages_in_again() -> None:
    default, kept = _page_faults_of_churn("default"), _page_faults_of_churn("keep")
    assert default > 10_000  # 20 rounds x 12 MiB of fresh pages: what the setting is for
    assert kept < 1_000, (default, kept)


def test_the_executable_sets_it_before_its_command_and_main_does_not(monkeypatch, tmp_path: Path) -> None:
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("set") or True)
    monkeypatch.setattr(cli, "run_command", lambda args: calls.append(args.command) or 0)
    monkeypatch.setattr(cli.os, "_exit", sys.exit)  # a frontier run ends with os._exit
    monkeypatch.setattr(sys, "argv", ["perseus-ext", "frontier", "--profile", "gpt3-175b-a40",
                                      "--microbatches", "2", "--out", str(tmp_path / "f.json")])
    with pytest.raises(SystemExit):
        cli.console()
    assert calls == ["set", "frontier"]
    calls.clear()
    cli.main(["frontier", "--profile", "gpt3-175b-a40", "--microbatches", "2", "--out", str(tmp_path / "f.json")])
    assert "set" not in calls
