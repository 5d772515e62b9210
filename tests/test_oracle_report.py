"""`perseus-ext report` on a fixed two-rank log, against figures computed by hand.

The report and the runtime's job summary both reduce iterations through `RunFigures`, so checking
one against the other cannot catch a mistake in it. Here the log is small and fixed, and every
expected figure below was worked out on paper from the table (the arithmetic is in the comments):
the job's iteration is the ranks' energy summed and the slowest rank's time, only over iterations
every rank recorded; probes and plan iterations are compared per regime; the interval is the
delta-method interval of a ratio of means with Welch's degrees of freedom. Where one side of a
comparison has no spread, Welch's degrees of freedom are the other side's count minus one, so the
t quantile is a textbook table value (12.7062 for one degree of freedom).
"""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from perseus_ext.cli import main

JOB = "oracle-job"
T_975_ONE_DOF = 12.706204736174698  # Student's t, 97.5th percentile, 1 degree of freedom (table)

# iteration, phase, factor, (rank 0: probe, time s, energy J), (rank 1: probe, time s, energy J)
ROWS = [
    (0, "warmup", None, (False, 1.0, 60.0), (False, 1.2, 40.0)),
    (1, "warmup", None, (False, 1.0, 62.0), (False, 1.0, 40.0)),
    (2, "profiling", None, (False, 1.5, 90.0), (False, 1.4, 50.0)),
    (3, "profiling", None, (False, 1.5, 88.0), (False, 1.6, 52.0)),
    (4, "solving", None, (False, 1.0, 61.0), (False, 1.0, 41.0)),
    (5, "deployed", 1.0, (False, 1.0, 50.0), (False, 1.0, 30.0)),
    (6, "deployed", 1.0, (False, 1.0, 50.0), (False, 1.02, 30.0)),
    (7, "deployed", 1.0, (True, 0.98, 60.0), (True, 0.97, 40.0)),
    (8, "deployed", 1.0, (False, 1.0, 50.0), (False, 1.0, 30.0)),
    (9, "deployed", 1.0, (True, 1.0, 62.0), (True, 0.99, 42.0)),
    (10, "deployed", 1.5, (False, 1.5, 40.0), (False, 1.5, 25.0)),
    (11, "deployed", 1.5, (False, 1.5, 40.0), (False, 1.5, 25.0)),
    (12, "deployed", 1.5, (True, 1.5, 70.0), (True, 1.5, 50.0)),
    (13, "deployed", 1.5, (False, 1.5, 40.0), (False, 1.5, 25.0)),
    (14, "deployed", 1.5, (True, 1.5, 68.0), (True, 1.5, 48.0)),
    (15, "deployed", 1.0, (True, 1.0, 60.0), (False, 1.0, 30.0)),  # the ranks disagree: "mixed"
    (16, "deployed", 1.0, (False, 1.0, 50.0), None),  # rank 1 never recorded it: not a job iteration
]


def _row(iteration: int, rank: int, phase: str, factor: float | None, probe: bool, time_s: float,
         energy_j: float, job: str = JOB) -> dict:
    deployed = phase == "deployed"
    return {"job": job, "iteration": iteration, "rank": rank, "pipeline": 0, "stage": rank, "phase": phase,
            "plan": 0 if deployed and not probe else None, "factor": factor, "fell_back": False, "probe": probe,
            "time_s": time_s, "energy_j": energy_j}


def write_logs(directory) -> list:
    """Rank 0's file starts with an earlier run of another job (a restart appending to the same
    log), which the report must leave out."""
    lines = {0: [_row(i, 0, "warmup", None, False, 9.0, 999.0, job="earlier-job") for i in range(3)], 1: []}
    for iteration, phase, factor, *ranks in ROWS:
        for rank, entry in enumerate(ranks):
            if entry is not None:
                lines[rank].append(_row(iteration, rank, phase, factor, *entry))
    paths = []
    for rank, rows in lines.items():
        path = directory / f"log-{rank}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    directory = tmp_path_factory.mktemp("oracle-report")
    out = directory / "analysis.json"
    assert main(["report", *map(str, write_logs(directory)), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_job_iterations_are_those_every_rank_recorded(analysis):
    job = analysis["job"]
    assert job["iterations"] == 16  # 0..15: the earlier job's run and rank 0's lone iteration 16 left out
    assert analysis["timeline"]["iterations"] == list(range(16))
    # energy summed over the ranks, time of the slowest
    assert analysis["timeline"]["energy_j"][:5] == pytest.approx([100.0, 102.0, 140.0, 140.0, 102.0])
    assert analysis["timeline"]["time_s"][:5] == pytest.approx([1.2, 1.0, 1.5, 1.6, 1.0])
    assert analysis["timeline"]["labels"][15] == "mixed"


def test_fastest_plan_regime_saving_and_its_interval(analysis):
    """Probes 7, 9: 100, 104 J (mean 102, variance 8, variance of the mean 4); plan iterations
    5, 6, 8: 80 J each (no spread). Saving 1 - 80/102 = 0.215686; the interval's half-width is
    t(1 dof) x (80/102) x sqrt(4/102^2) = 12.7062 x 160/10404 = 0.195405."""
    intrinsic = analysis["job"]["measured"]["intrinsic"]
    assert (intrinsic["probes"], intrinsic["deployed"]) == (2, 3)
    assert intrinsic["default_energy_j"] == pytest.approx(102.0)
    assert intrinsic["deployed_energy_j"] == pytest.approx(80.0)
    assert intrinsic["saving"] == pytest.approx(1 - 80 / 102, rel=1e-12)
    half = T_975_ONE_DOF * 160 / 10404
    assert half == pytest.approx(0.195405, abs=1e-6)
    assert intrinsic["saving_low"] == pytest.approx(1 - 80 / 102 - half, rel=1e-9)
    assert intrinsic["saving_high"] == pytest.approx(1 - 80 / 102 + half, rel=1e-9)
    # times: probes 0.98, 1.0 (mean 0.99); plan iterations 1.0, 1.02, 1.0 (mean 1.006667)
    assert intrinsic["default_time_s"] == pytest.approx(0.99)
    assert intrinsic["deployed_time_s"] == pytest.approx(3.02 / 3)
    assert intrinsic["time_change"] == pytest.approx(3.02 / 3 / 0.99 - 1, rel=1e-12)


def test_straggler_regime_saving_and_its_interval(analysis):
    """Probes 12, 14 (factor 1.5): 120, 116 J (mean 118, variance of the mean 4); plan iterations
    10, 11, 13: 65 J each. Saving 1 - 65/118 = 0.449153, half-width 12.7062 x 130/13924 = 0.118630."""
    extrinsic = analysis["job"]["measured"]["extrinsic"]
    assert (extrinsic["probes"], extrinsic["deployed"]) == (2, 3)
    assert extrinsic["saving"] == pytest.approx(1 - 65 / 118, rel=1e-12)
    half = T_975_ONE_DOF * 130 / 13924
    assert half == pytest.approx(0.118630, abs=1e-6)
    assert (extrinsic["saving_low"], extrinsic["saving_high"]) == pytest.approx(
        (1 - 65 / 118 - half, 1 - 65 / 118 + half), rel=1e-9)
    assert extrinsic["time_change"] == pytest.approx(0.0, abs=1e-12)  # 1.5 s on both sides


def test_overall_saving_interval_probe_cost_and_defaults(analysis):
    """All regimes: probes 100, 104, 120, 116 J (mean 110, squared deviations 272, variance of the
    mean 272/12); plan iterations 80 x 3, 65 x 3 (mean 72.5, squared deviations 337.5, variance of
    the mean 67.5/6 = 11.25). Relative variances a = 11.25/72.5^2, b = (272/12)/110^2; Welch's
    degrees of freedom (a + b)^2 / (a^2/5 + b^2/3) = 7.72."""
    measured = analysis["job"]["measured"]
    overall = measured["all"]
    assert (overall["probes"], overall["deployed"]) == (4, 6)  # the mixed iteration 15 is neither
    assert overall["default_energy_j"] == pytest.approx(110.0)
    assert overall["deployed_energy_j"] == pytest.approx(72.5)
    ratio = 72.5 / 110
    assert overall["saving"] == pytest.approx(1 - ratio, rel=1e-12)
    a, b = 11.25 / 72.5 ** 2, (272 / 12) / 110 ** 2
    dof = (a + b) ** 2 / (a * a / 5 + b * b / 3)
    assert dof == pytest.approx(7.7228, abs=1e-3)
    half = stats.t.ppf(0.975, dof) * ratio * math.sqrt(a + b)
    assert (overall["saving_low"], overall["saving_high"]) == pytest.approx((1 - ratio - half, 1 - ratio + half),
                                                                            rel=1e-9)
    # times: probes 0.98 + 1.0 + 1.5 + 1.5 = 4.98 (mean 1.245); plans 7.52 / 6
    assert overall["time_change"] == pytest.approx((7.52 / 6) / 1.245 - 1, rel=1e-12)
    # probes forgo 4 x (110 - 72.5) = 150 J of the 440 + 435 = 875 J of deployed energy
    cost = measured["probe_cost"]
    assert cost["probes"] == 4 and cost["share_of_deployed"] == pytest.approx(4 / 10)
    assert cost["energy_j"] == pytest.approx(150.0) and cost["share_of_energy"] == pytest.approx(150 / 875)
    assert analysis["job"]["default_per_iteration"] == pytest.approx({"energy_j": 110.0, "time_s": 1.245})


@pytest.mark.parametrize("label, iterations, time_s, energy_j", [
    ("warmup", 2, 2.2, 202.0),  # 1.2 + 1.0 s; 100 + 102 J
    ("profiling", 2, 3.1, 280.0),  # 1.5 + 1.6 s; 140 + 140 J
    ("solving", 1, 1.0, 102.0),
    ("deployed", 6, 7.52, 435.0),
    ("baseline probe", 4, 4.98, 440.0),
    ("mixed", 1, 1.0, 90.0),
])
def test_phase_costs_against_the_default_clock_figures(analysis, label, iterations, time_s, energy_j):
    """Each label's extra cost is measured against the probes' 110 J and 1.245 s per iteration."""
    group = analysis["job"]["phase_costs"][label]
    assert group["iterations"] == iterations
    assert group["time_s"] == pytest.approx(time_s) and group["energy_j"] == pytest.approx(energy_j)
    assert group["extra_energy_j"] == pytest.approx(energy_j - 110.0 * iterations)
    assert group["extra_time_s"] == pytest.approx(time_s - 1.245 * iterations)


def test_the_phase_costs_hold_every_job_iteration_and_nothing_else(analysis):
    costs = analysis["job"]["phase_costs"]
    assert set(costs) == {"warmup", "profiling", "solving", "deployed", "baseline probe", "mixed"}
    assert sum(group["iterations"] for group in costs.values()) == 16


def test_each_ranks_own_saving(analysis):
    """Rank 0 (iterations 0-16 of its latest run): probes 60, 62, 70, 68, 60 J (mean 64), plan
    iterations 50, 50, 50, 40, 40, 40, 50 J (mean 320/7): saving 1 - 320/448 = 2/7. Rank 1:
    probes 40, 42, 50, 48 (mean 45), plans 30 x 3, 25 x 3, 30 (mean 195/7): 1 - 195/315 = 8/21."""
    ranks = {int(rank): entry for rank, entry in analysis["ranks"].items()}
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["iterations"] == 17 and ranks[1]["iterations"] == 16
    first, second = ranks[0]["measured"]["all"], ranks[1]["measured"]["all"]
    assert (first["probes"], first["deployed"], second["probes"], second["deployed"]) == (5, 7, 4, 7)
    assert first["saving"] == pytest.approx(2 / 7, rel=1e-12)
    assert second["saving"] == pytest.approx(8 / 21, rel=1e-12)
