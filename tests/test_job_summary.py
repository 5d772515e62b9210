"""The job's figure at close: every rank reduces its iterations into the job's, rank 0 logs one
line, and it is the figure `perseus-ext report` computes from the same runs' logs. A rank whose
peers never close (or whose control plane failed) still closes within a bounded wait.

The summary and the report share `RunFigures`, so their agreement alone proves little: both are
also checked against `figures_by_hand`, which recomputes the job's saving from the logs' rows with
plain Python and numpy (tests/test_oracle_report.py checks `RunFigures` on a hand-computed log)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from perseus_ext.planning.schedule import build_schedule
from perseus_ext.observability.reporting import analyse, read_logs
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.observability.summary_text import job_line

from runtime_helpers import free_port, make_config, sim_gpu, train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))
CONTROL_TIMEOUT_S = 12.0
CLOSE_WAIT_S = 2.0  # the wait at close for the others, shorter than the groups' timeout (as by default)
JOB_KEYS = ("iterations", "measured", "default_per_iteration", "phase_costs")


def figures_by_hand(paths: list[Path]) -> dict:
    """The job's iteration count and measured saving from the logs' rows, with nothing of
    perseus-ext: a job iteration is one every rank logged (energy summed, time of the slowest);
    it is a probe or a plan iteration only when every rank says so; the saving is 1 - mean plan
    energy / mean probe energy, its 95 % interval the delta method with Welch's degrees of freedom."""
    ranks = []
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ranks.append({row["iteration"]: row for row in rows})
    assert len(ranks) >= 1
    common = sorted(set.intersection(*(set(rank) for rank in ranks)))
    sides: dict[str, list[float]] = {"probe": [], "plan": []}
    for iteration in common:
        rows = [rank[iteration] for rank in ranks]
        kinds = {"fallback" if row["fell_back"] else "probe" if row["probe"] else
                 "plan" if row["phase"] == "deployed" else row["phase"] for row in rows}
        if len(kinds) == 1 and kinds <= {"probe", "plan"} and all(row["energy_j"] is not None for row in rows):
            sides[kinds.pop()].append(sum(row["energy_j"] for row in rows))
    probes, plans = np.array(sides["probe"]), np.array(sides["plan"])
    ratio = plans.mean() / probes.mean()
    a = plans.var(ddof=1) / len(plans) / plans.mean() ** 2
    b = probes.var(ddof=1) / len(probes) / probes.mean() ** 2
    dof = (a + b) ** 2 / (a * a / (len(plans) - 1) + b * b / (len(probes) - 1))
    half = stats.t.ppf(0.975, dof) * ratio * np.sqrt(a + b)
    return {"iterations": len(common), "probes": len(probes), "deployed": len(plans),
            "default_energy_j": probes.mean(), "saving": 1 - ratio,
            "saving_low": 1 - ratio - half, "saving_high": 1 - ratio + half}


def assert_the_hand_figures(job: dict, hand: dict) -> None:
    assert job["iterations"] == hand["iterations"]
    overall = job["measured"]["all"]
    assert (overall["probes"], overall["deployed"]) == (hand["probes"], hand["deployed"])
    for key in ("default_energy_j", "saving", "saving_low", "saving_high"):
        assert overall[key] == pytest.approx(hand[key], rel=1e-9), key


@pytest.mark.distributed
def test_a_single_rank_job_logs_the_reports_figure(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="perseus_ext")
    log = tmp_path / "log-{rank}.jsonl"
    runtime = PerseusRuntime(make_config(baseline_fraction=0.5, straggler_check_interval=2, log_path=str(log)),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    train(runtime, 40)
    runtime.close()
    job = runtime.summary()["job"]
    report = analyse(read_logs([tmp_path / "log-0.jsonl"]))["job"]
    assert {key: job[key] for key in JOB_KEYS} == {key: report[key] for key in JOB_KEYS}
    assert_the_hand_figures(job, figures_by_hand([tmp_path / "log-0.jsonl"]))
    assert job["measured"]["all"]["probes"] >= 3 and job["ranks"] == 1 and job["fell_back_ranks"] == 0
    lines = {record.getMessage(): record.levelno for record in caplog.records if "summary" in record.getMessage()}
    assert lines[job_line(job)] == logging.INFO
    assert [level for line, level in lines.items() if "rank 0 summary" in line] == [logging.DEBUG]


def test_a_rank_whose_control_plane_failed_reports_no_job_figure(caplog):
    caplog.set_level(logging.INFO, logger="perseus_ext")
    runtime = PerseusRuntime(make_config(), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    train(runtime, 3)
    runtime.control_plane_failed = True  # what a timed-out lifecycle collective leaves behind
    runtime.close()
    summary = runtime.summary()
    assert summary["job"] is None
    assert "no job summary (this rank's control plane failed earlier" in caplog.text
    assert "rank 0 summary" in caplog.text  # its own figures stay at INFO instead


RANK_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys, time
    import torch.distributed as dist
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import PerseusRuntime
    import perseus_ext.runtime.summary as summary_module
    from runtime_helpers import make_config, sim_gpu, train

    rank, port, out, scenario, timeout_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    summary_module.JOB_SUMMARY_WAIT_S = float(sys.argv[6])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("perseus_ext").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = make_config(control_timeout_s=timeout_s, baseline_fraction=0.25, straggler_check_interval=2,
                         log_path=f"{out}/log-{{rank}}.jsonl")
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 2, 4), stage=rank, gpu=sim_gpu(seed=rank))
    train(runtime, 44 if scenario == "close" else 4)
    if scenario == "absent" and rank == 1:  # alive, but never closes (stuck elsewhere)
        time.sleep(4 * summary_module.JOB_SUMMARY_WAIT_S)
        sys.exit(0)
    started = time.perf_counter()
    runtime.close()
    summary = runtime.summary()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump({"close_s": time.perf_counter() - started, "summary": summary}, handle)
    """
)


def assert_close(ours, theirs, where: str) -> None:
    """Nested figures equal, floats to 1e-12 relative."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), where
        for key in theirs:
            assert_close(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-12), where
    else:
        assert ours == theirs, where


def run_two_ranks(tmp_path: Path, scenario: str) -> tuple[list[dict | None], str]:
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), port, str(tmp_path), scenario,
                               str(CONTROL_TIMEOUT_S), str(CLOSE_WAIT_S)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True, cwd=tmp_path)
             for rank in (0, 1)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=180)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    for process, output in zip(ranks, outputs):
        assert process.returncode == 0, output[-4000:]
    results = [json.loads(path.read_text()) if path.exists() else None
               for path in (tmp_path / "rank0.json", tmp_path / "rank1.json")]
    return results, outputs[0]


@pytest.mark.distributed
def test_two_ranks_agree_on_the_job_figure_and_it_is_the_reports(tmp_path):
    (first, second), output = run_two_ranks(tmp_path, "close")
    job = first["summary"]["job"]
    assert job == second["summary"]["job"]  # every rank holds the same figure; rank 0 logs it
    report = analyse(read_logs(sorted(tmp_path.glob("log-*.jsonl"))))["job"]
    assert job["iterations"] == report["iterations"] == 44
    for key in JOB_KEYS[1:]:
        assert_close(job[key], report[key], key)  # energy summed in another order: last-bit differences
    assert_the_hand_figures(job, figures_by_hand(sorted(tmp_path.glob("log-*.jsonl"))))
    overall = job["measured"]["all"]
    assert overall["probes"] >= 3 and overall["saving_low"] < overall["saving"] < overall["saving_high"]
    ranks = [first["summary"]["measured"]["all"], second["summary"]["measured"]["all"]]
    assert overall["default_energy_j"] == pytest.approx(sum(r["default_energy_j"] for r in ranks), rel=1e-9)
    assert job_line(job) in output and output.count("job summary") == 1
    assert "rank 0 summary" not in output and "rank 1 summary" not in output  # DEBUG now


@pytest.mark.distributed
def test_a_rank_whose_peer_never_closes_gives_up_after_the_bounded_wait(tmp_path):
    (first, second), output = run_two_ranks(tmp_path, "absent")
    assert second is None
    assert first["summary"]["job"] is None
    assert CLOSE_WAIT_S - 0.2 < first["close_s"] < CLOSE_WAIT_S + 4.0, first["close_s"]
    assert "no job summary (gathering the ranks' figures failed: the pipeline group's ranks did not all join in time" in output
    assert "rank 0 summary" in output  # its own figures at INFO instead


@pytest.mark.distributed
def test_the_summary_has_the_set_calls_measured_live_and_assumed_in_dry_run():
    """A live run times its clock set calls (the figure that should replace a GPU's preset);
    a dry-run says which duration it assumed for them."""
    live = PerseusRuntime(make_config(), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu(call_ms="5"))
    train(live, 12)
    live.close()
    calls = live.summary()["clock_coverage"]["set_call_ms"]
    assert calls["measured_calls"] > 0 and 5.0 <= calls["measured_median"] < 50.0 and calls["assumed"] == 5.0
    dry = PerseusRuntime(make_config(dry_run=True), schedule=build_schedule("1f1b", 1, 4), stage=0,
                         gpu=sim_gpu(call_ms="5"))
    train(dry, 3)
    dry.close()
    calls = dry.summary()["clock_coverage"]["set_call_ms"]
    assert calls["measured_calls"] == 0 and calls["measured_median"] is None and calls["assumed"] == 5.0
