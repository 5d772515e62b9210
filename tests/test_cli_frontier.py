"""`perseus-ext frontier`: JSON output, plot, summary and error handling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perseus_ext.cli import main
from perseus_ext.data import shipped_profile
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import one_f_one_b

A100 = shipped_profile("gpt3-175b-a100_sxm")


@pytest.fixture()
def four_stage_profile(tmp_path: Path) -> Path:
    raw = load_profile(A100)
    rows = [r for r in raw.rows() if r["stage"] < 4 and r["frequency"] >= 1200]
    path = tmp_path / "slice-4stages.csv"  # names no GPU: no default blocking power
    Profile.from_rows(rows).save(path)
    return path


def test_frontier_writes_json_plot_and_summary(tmp_path: Path, four_stage_profile: Path, capsys) -> None:
    out, plot = tmp_path / "frontier.json", tmp_path / "frontier.png"
    code = main([
        "frontier", "--profile", str(four_stage_profile), "--microbatches", "6",
        "--blocking-power", "83.64", "--out", str(out), "--plot", str(plot),
    ])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["schedule"] == {"kind": "1f1b", "stages": 4, "microbatches": 6, "virtual_stages": 1}
    assert len(data["plans"]) >= 2
    times = [p["time"] for p in data["plans"]]
    assert times == sorted(times)
    assert all(len(p["frequencies"]) == 4 and len(p["frequencies"][0]) == 12 for p in data["plans"])
    # Each plan's numbers are the replay of its clocks.
    model = CostModel(one_f_one_b(4, 6), load_profile(four_stage_profile), 83.64)
    for entry in data["plans"][:: max(1, len(data["plans"]) // 10)]:
        plan = Plan.from_dict(entry)
        time, energy = model.replay(model.choice_of(plan))
        assert entry["time"] == pytest.approx(time) and entry["energy"] == pytest.approx(energy)
    assert plot.stat().st_size > 10_000
    summary = capsys.readouterr().out
    assert "T_min" in summary and "intrinsic saving" in summary and "T* (min energy)" in summary


def test_wait_aware_frontier_and_its_useful_clocks(tmp_path: Path, capsys) -> None:
    """`--wait-aware` appends the plans for an iteration held to a deadline (Pareto in time and
    energy - P_block S time, slower than T* where energy rises again); the summary counts the
    clocks the planner keeps at this blocking power (the published A100 profile: 472 of 608)."""
    out, plot = tmp_path / "f.json", tmp_path / "f.png"
    assert main([
        "frontier", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "4", "--wait-aware",
        "--out", str(out), "--plot", str(plot),
    ]) == 0
    summary = capsys.readouterr().out
    assert "useful clocks  472 of 608 measured" in summary and " wait-aware" in summary
    data = json.loads(out.read_text())
    start = data["extension_start"]
    ordinary, extension = data["plans"][:start], data["plans"][start:]
    assert extension and extension[-1]["time"] > ordinary[-1]["time"]
    slope = 8 * 83.64
    costs = [p["energy"] - slope * p["time"] for p in extension]
    assert all(a > b for a, b in zip(costs, costs[1:]))  # each later one is cheaper once held
    assert plot.stat().st_size > 10_000


def test_shipped_profile_by_name_and_interleaved(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    assert main([
        "frontier", "--profile", "gpt3-175b-a40", "--stages", "8", "--microbatches", "8",
        "--schedule", "interleaved", "--virtual-stages", "2", "--out", str(out),
    ]) == 0
    data = json.loads(out.read_text())
    assert data["blocking_power"] == 70.38  # published A40 value, from the profile's name
    assert np.array(data["plans"][0]["frequencies"]).shape == (8, 32)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile", "nope"], "no such file, nor a shipped profile"),
        (["--profile", "gpt3-175b-a100_sxm", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3"],
         "microbatches >= stages"),
        (["--profile", "gpt3-175b-a100_sxm", "--stages", "4"], "has 8 stages but the schedule has 4"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args: list[str], message: str, capsys) -> None:
    if "--microbatches" not in args:
        args = args + ["--microbatches", "8"]
    assert main(["frontier", *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_gpu_needs_blocking_power(four_stage_profile: Path, capsys) -> None:
    assert main(["frontier", "--profile", str(four_stage_profile), "--microbatches", "4"]) == 2
    assert "--blocking-power is needed" in capsys.readouterr().err


def test_frontier_command_imports_only_what_it_needs(tmp_path: Path) -> None:
    """Start-up is part of the command's time: no SQLAlchemy (policies), torch, plotting or
    config machinery on the way to a frontier (reading the blocking power once pulled in the
    emulator package and with it the policies and SQLAlchemy, ~0.8 s)."""
    out = tmp_path / "f.json"
    code = (
        "import sys\n"
        "from perseus_ext.cli import main\n"
        f"assert main(['frontier', '--profile', 'gpt3-175b-a100_sxm', '--microbatches', '2', "
        f"'--blocking-power', 'a100', '--out', {str(out)!r}]) == 0\n"
        "heavy = ('sqlalchemy', 'torch', 'matplotlib', 'pydantic', 'scipy', 'tqdm', 'networkx',\n"
        "         'perseus_ext.emulator', 'perseus_ext.policies', 'perseus_ext.runtime',\n"
        "         'importlib.metadata', 'numpy.ma', 'statistics')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert json.loads(out.read_text())["blocking_power"] == 83.64


def test_the_executable_prints_only_its_summary_and_exits_at_once(tmp_path: Path) -> None:
    """`python -m perseus_ext` (the executable's entry point): a summary on stdout and nothing
    else (highspy 1.16's constructor printed its banner there), every line flushed before the
    immediate exit, the frontier written, exit 0; a usage error still exits 2."""
    out = tmp_path / "f.json"
    command = [sys.executable, "-m", "perseus_ext", "frontier", "-q", "--profile", "gpt3-175b-a100_sxm",
               "--microbatches", "2", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["profile", "useful", "schedule", "solved", "all", "T_min", "T*",
                                                 "swing", "swing", "swing", "wrote"]
    assert "HiGHS" not in result.stdout + result.stderr
    assert json.loads(out.read_text())["plans"]
    bad = subprocess.run(command[:-2] + ["--resolution", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--resolution" in bad.stderr
