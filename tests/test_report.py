"""`perseus-ext report`: the job's measured saving from every rank's JSONL log."""

from __future__ import annotations

import json

import pytest

from perseus_ext.cli import main
from perseus_ext.observability.reporting import analyse, read_logs


def write_log(path, rank, iterations, *, restart_before=0):
    """A two-stage-like log: warm-up, profiling, solving, then deployed with a probe every 5th
    iteration (default clocks: 100 J on rank 0, 50 J on rank 1; plans save 20 %)."""
    rows = []
    for i in range(restart_before):  # an earlier run appended to the same file
        rows.append({"iteration": i, "rank": rank, "phase": "warmup", "time_s": 9.0, "energy_j": 999.0})
    base = 100.0 if rank == 0 else 50.0
    for i in range(iterations):
        phase = "warmup" if i < 2 else "profiling" if i < 6 else "solving" if i < 8 else "deployed"
        probe = phase == "deployed" and i % 5 == 0
        plan = 0 if phase == "deployed" and not probe else None
        energy = {"warmup": base, "profiling": 1.3 * base, "solving": base}.get(phase, base if probe else 0.8 * base)
        energy += (i % 3) * 0.5  # a little noise
        rows.append({"timestamp": 1.0 + i, "iteration": i, "rank": rank, "pipeline": 0, "stage": rank,
                     "phase": phase, "plan": plan, "factor": 1.0 if phase == "deployed" else None,
                     "fell_back": False, "probe": probe, "time_s": 1.0 if phase != "profiling" else 1.4,
                     "compute_s": 0.9, "energy_j": energy, "coverage": 0.95 if plan is not None else None})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_report_prints_the_job_saving_with_its_interval_and_draws_the_timeline(tmp_path, capsys):
    write_log(tmp_path / "log-0.jsonl", 0, 60, restart_before=5)
    write_log(tmp_path / "log-1.jsonl", 1, 60)
    figure, analysis_path = tmp_path / "timeline.png", tmp_path / "analysis.json"
    code = main(["report", str(tmp_path / "log-0.jsonl"), str(tmp_path / "log-1.jsonl"),
                 "--figure", str(figure), "--json", str(analysis_path)])
    out = capsys.readouterr().out
    assert code == 0 and figure.stat().st_size > 10_000
    analysis = json.loads(analysis_path.read_text())
    job = analysis["job"]
    assert job["iterations"] == 60  # the earlier run of rank 0 is left out
    overall = job["measured"]["all"]
    assert overall["default_energy_j"] == pytest.approx(150.0, abs=1.0)
    assert overall["saving_low"] < 0.2 < overall["saving_high"] and overall["saving"] == pytest.approx(0.2, abs=0.01)
    assert overall["probes"] == 10 and job["measured"]["probe_cost"]["share_of_deployed"] == pytest.approx(10 / 52)
    assert job["phase_costs"]["profiling"]["extra_energy_j"] == pytest.approx(4 * 0.3 * 150, rel=0.05)
    assert "(10 probes)" in out and "measured vs baseline probes" in out and "lifecycle cost" in out
    assert "10 iterations" in out.split("baseline probes:")[1].splitlines()[0]
    assert "baseline probe" in analysis["timeline"]["labels"]


def test_report_rejects_what_is_not_a_perseus_log(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"rank": 0}\n')
    assert main(["report", str(bad)]) == 2
    assert "bad.jsonl:1: iteration: Field required; give the JSONL files" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2


def test_report_of_an_observing_run_gives_default_figures(tmp_path):
    rows = [{"iteration": i, "rank": 0, "phase": "observing", "time_s": 1.0, "energy_j": 10.0 + i % 2}
            for i in range(10)]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    analysis = analyse(read_logs([tmp_path / "log.jsonl"]))
    assert analysis["job"]["measured"]["all"] is None
    assert analysis["job"]["default_per_iteration"]["energy_j"] == pytest.approx(10.5, abs=0.06)
