"""`perseus-ext report DIR`: a folder of logs, a multi-line report at 100 columns, and logs of
two jobs whose rows carry no job id refused by their timestamps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from perseus_ext.cli import main
from perseus_ext.inputs import InputError
from perseus_ext.observability.log_files import JOB_GAP_S, read_logs

START_S = 1_790_000_000.0  # a wall-clock time in 2026


def rows(rank: int, iterations: int, *, start_s: float = START_S, job: str | None = "job-a",
         step_s: float = 1.0) -> list[dict]:
    """A stage's log: warm-up, profiling, solving, then deployed with a probe every 4th iteration
    (default clocks 100 J on rank 0, 60 J on rank 1; plans save 20 %, a little noise)."""
    out = []
    base = 100.0 if rank == 0 else 60.0
    for i in range(iterations):
        phase = "warmup" if i < 2 else "profiling" if i < 6 else "solving" if i < 7 else "deployed"
        probe = phase == "deployed" and i % 4 == 0
        energy = (base if phase != "deployed" or probe else 0.8 * base) + (i % 3) * 0.7
        row = {"timestamp": start_s + step_s * i, "iteration": i, "rank": rank, "pipeline": 0, "stage": rank,
               "phase": phase, "plan": 0 if phase == "deployed" and not probe else None,
               "factor": 1.0 if phase == "deployed" else None, "fell_back": False, "probe": probe,
               "time_s": 1.4 if phase == "profiling" else 1.0, "energy_j": energy}
        if job is not None:
            row["job"] = job
        out.append(row)
    return out


def write(path: Path, entries: list[dict]) -> Path:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return path


def test_a_folder_reads_as_its_jsonl_files_and_prints_rows_at_100_columns(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs / "rank-0.jsonl", rows(0, 60))
    write(logs / "rank-1.jsonl", rows(1, 60))
    (logs / "summary-0.json").write_text("{}")  # a summary beside the logs is not a log
    assert main(["report", str(logs)]) == 0
    from_folder = capsys.readouterr().out
    assert main(["report", str(logs / "rank-0.jsonl"), str(logs / "rank-1.jsonl")]) == 0
    assert capsys.readouterr().out == from_folder
    lines = from_folder.splitlines()
    assert len(lines) > 15 and all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert lines[0].startswith("job job-a: 2 ranks, 60 iterations")
    # the job's saving from the rows themselves: energy summed over the ranks, plans vs probes
    job = [sum(r["energy_j"] for r in pair) for pair in zip(rows(0, 60), rows(1, 60)) if pair[0]["phase"] == "deployed"]
    probes = [energy for energy, row in zip(job, rows(0, 60)[7:]) if row["probe"]]
    plans = [energy for energy, row in zip(job, rows(0, 60)[7:]) if not row["probe"]]
    expected = 1 - (sum(plans) / len(plans)) / (sum(probes) / len(probes))
    saving = next(line for line in lines if line.lstrip().startswith("saving:"))
    assert saving.split()[1] == f"{100 * expected:.1f}%"
    table = next(k for k, line in enumerate(lines) if line.split()[:3] == ["rank", "pipeline", "stage"])
    assert [lines[table + 2 + rank].split()[:4] for rank in (0, 1)] == [["0", "0", "0", "60"], ["1", "0", "1", "60"]]
    assert "need: probes the interval needs for ±5 points" in " ".join(line.strip() for line in lines)


def test_an_empty_folder_is_one_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty: the folder holds no .jsonl file" in err[0]


def test_logs_without_a_job_id_from_two_times_are_refused(tmp_path, capsys):
    yesterday = write(tmp_path / "old-0.jsonl", rows(0, 40, job=None, start_s=START_S - 86400))
    today = write(tmp_path / "new-1.jsonl", rows(1, 40, job=None))
    assert main(["report", str(yesterday), str(today)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "the logs are of 2 different jobs by their timestamps (their rows carry no job id)" in err[0]
    assert "old-0.jsonl ran 2026-09-20" in err[0] and "new-1.jsonl ran 2026-09-21" in err[0]
    # the same two ranks logged at the same time: one job
    write(tmp_path / "old-0.jsonl", rows(0, 40, job=None))
    assert main(["report", str(yesterday), str(today)]) == 0
    assert "job (its rows carry no job id): 2 ranks, 40 iterations" in capsys.readouterr().out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset_s=st.floats(min_value=-3 * 3600.0, max_value=3 * 3600.0, allow_nan=False),
       length=st.integers(min_value=8, max_value=30), step_s=st.floats(min_value=0.5, max_value=90.0))
def test_runs_are_one_job_exactly_when_their_spans_meet(tmp_path, offset_s, length, step_s):
    first = write(tmp_path / "a.jsonl", rows(0, length, job=None, step_s=step_s))
    second = write(tmp_path / "b.jsonl", rows(1, length, job=None, start_s=START_S + offset_s, step_s=step_s))
    span_s = step_s * (length - 1)
    # the gap between the two spans (negative: they overlap), computed from the rows written
    gap_s = max(offset_s - span_s, -offset_s - span_s)
    assume(abs(gap_s - JOB_GAP_S) > 1e-6)  # on the boundary float rounding decides
    if gap_s > JOB_GAP_S:
        with pytest.raises(InputError, match="different jobs by their timestamps"):
            read_logs([first, second])
    else:
        assert [run.rank for run in read_logs([first, second]).runs] == [0, 1]
