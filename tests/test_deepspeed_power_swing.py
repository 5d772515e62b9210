"""A DeepSpeed job with a power-swing cap deploys its plans' fillers and reports its measured swing.

DeepSpeed's pipeline engine over gloo, 2 stages x 1 pipeline on paced simulated A100s, planned on
the simulated GPU's own model (a saved profile: no profiling) with `perseus.solver.power_swing_cap`.
Every rank deploys; the job summary, every rank's summary and `perseus-ext report` on the logs
carry the measured swing from the devices' 1 ms power samples, and they agree: the runtime sums
the ranks' samples over the control plane at close, the report from the logs. The swing is also
checked against the devices' known powers: no 1 ms sample of one GPU lies outside [idle power,
the compute power of the fastest clock], so the job's trough and peak lie within 2 x those.

The simulated devices draw the deployed plan's filler (`actuation/filler.py`), so what runs is
what was planned: the measured job swing is the deployed plan's planned swing within
`SWING_TOLERANCE` of the all-max-clock swing, and the measured energy per iteration its model
energy within the runtime's model check (`deployment.MODEL_DISAGREEMENT`). The devices queue 8
launches (`queue_depth`), as a GPU's stream runs far ahead of its host: with 2, this shared
CPU's host hiccups leave the device idle between computations, gaps the plan's model has not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime_helpers import profile_of_model

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.planning.energy import BLOCKING_POWER_W

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency"
)

LAUNCH_TIMEOUT_S = 240
ITERATIONS = 14
FORWARD_S, BACKWARD_S = [0.010, 0.014], [0.020, 0.028]
CLOCKS_MHZ = [1410, 1200, 1005, 810]
SWING_CAP = 0.5
# Each hand-over between stages takes the simulated link's 0.1 ms, which the plan's model has
# not: both GPUs then wait at their own share of the filler, and a 1 ms sample dips by about a
# tenth of the filler (~20 W at this cap). 10 % of the all-max-clock swing (~39 W) bounds it.
SWING_TOLERANCE = 0.10


def model_profile(path: Path) -> str:
    return profile_of_model(path, open_gpu("sim:a100_sxm?pace=0"), FORWARD_S, BACKWARD_S, CLOCKS_MHZ)


@pytest.fixture(scope="module")
def capped_job(tmp_path_factory):
    from perseus_ext import demo

    out_dir = tmp_path_factory.mktemp("swing-cap")
    perseus = {"profile_path": model_profile(out_dir / "profile.csv"), "candidate_clocks": CLOCKS_MHZ,
               "gpu": "sim:a100_sxm?queue_depth=8",
               "clock_stride": 1, "baseline_fraction": 0.0, "log_interval": 0,
               "blocking_power_w": BLOCKING_POWER_W["a100"],
               "solve_in_background": False,  # deployed from the iteration after warm-up, whatever the solve takes
               "solver": {"min_grid_points": 300, "power_swing_cap": SWING_CAP}}
    scenario = demo.Scenario(out_dir=str(out_dir), stages=2, pipelines=1, iterations=ITERATIONS,
                             straggler_pipeline=None, variants=["perseus"], perseus=perseus,
                             forward_seconds=FORWARD_S, backward_seconds=BACKWARD_S)
    return scenario, demo.launch(scenario, timeout_s=LAUNCH_TIMEOUT_S)


def test_the_capped_job_deploys_and_reports_its_measured_swing(capped_job):
    from perseus_ext import demo
    from perseus_ext.observability.reporting import analyse, read_logs
    from perseus_ext.observability.summary_text import job_line

    scenario, results = capped_job
    ranks = demo.by_variant(results, "perseus")
    assert len(ranks) == 2
    summaries = [rank["summary"] for rank in ranks]
    assert all(s["final_phase"] == "deployed" and s["deployed"]["iterations"] >= 6 for s in summaries)
    job = summaries[0]["job"]["power_swing"]
    assert job["measured"] and job["ranks"] == 2 and job == summaries[1]["job"]["power_swing"]
    gpu = open_gpu("sim:a100_sxm?pace=0")
    idle_w, top_w = gpu.preset.idle_power_w, gpu.preset.compute_power_w(max(CLOCKS_MHZ))
    # Bins are cut from a cumulative energy at device times of the host's monotonic clock (days
    # of uptime, in seconds): rounding leaves about a milliwatt, never a watt.
    slack_w = 1e-3
    for summary in summaries:
        own = summary["power_swing"]
        assert own["measured"] and own["peak_to_trough_w"] <= top_w - idle_w + slack_w
        assert idle_w - slack_w <= own["mean_w"] <= top_w + slack_w
    assert 2 * idle_w - slack_w <= job["mean_w"] <= 2 * top_w + slack_w
    assert 0.0 < job["peak_to_trough_w"] <= 2 * (top_w - idle_w) + slack_w
    per_rank = summaries[0]["job"]["per_rank"]  # the job summary's table: each GPU's own swing
    assert [entry["power_swing_w"] for entry in per_rank] == pytest.approx(
        [summary["power_swing"]["peak_to_trough_w"] for summary in summaries])
    assert "swing W" in job_line(summaries[0]["job"])
    report = analyse(read_logs(sorted(Path(scenario.out_dir).glob("log-perseus-*.jsonl"))))["job"]["power_swing"]
    assert report["iterations"] == job["iterations"] and report["ranks"] == 2
    for key in ("mean_w", "peak_to_trough_w", "max_ramp_w_per_s"):
        assert report[key] == pytest.approx(job[key], rel=1e-4, abs=0.01), key  # the logs keep milliwatts
    # the job planned with the cap: its frontier is the capped solve's, done here offline
    from perseus_ext.planning.options import SolverOptions
    from perseus_ext.planning.profile import load_profile
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.planning.solver import solve_frontier

    capped = solve_frontier(build_schedule("1f1b", 2, scenario.microbatches),
                            load_profile(Path(scenario.out_dir) / "profile.csv"), BLOCKING_POWER_W["a100"],
                            options=SolverOptions(min_grid_points=300, power_swing_cap=SWING_CAP))
    deployed = summaries[0]["frontier"]
    assert deployed["plans"] == len(capped.plans)
    assert deployed["fastest"]["energy_j"] == pytest.approx(capped.fastest.energy)


def test_the_devices_draw_the_deployed_plan_s_filler_so_its_planned_swing_and_energy_run(capped_job):
    """Measured with: pytest tests/test_deepspeed_power_swing.py (the figures are in the asserts'
    messages when they fail)."""
    from perseus_ext import demo
    from perseus_ext.planning.filler_program import solve_capped
    from perseus_ext.planning.options import SolverOptions
    from perseus_ext.planning.profile import load_profile
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime.deployment import MODEL_DISAGREEMENT

    scenario, results = capped_job
    summaries = [rank["summary"] for rank in demo.by_variant(results, "perseus")]
    switches = summaries[0]["plan_switches"]
    assert [switch["plan"] for switch in switches] == [switches[0]["plan"]]  # one plan deployed throughout
    plan = switches[0]["plan"]
    # the plan as the pipeline leader planned it (the runtime charges half the preset's ramp per change)
    ramp_s = open_gpu("sim:a100_sxm?pace=0").switch_latency.transition_s
    options = SolverOptions(min_grid_points=300, power_swing_cap=SWING_CAP)
    frontier, capped = solve_capped(build_schedule("1f1b", 2, scenario.microbatches),
                                    load_profile(Path(scenario.out_dir) / "profile.csv"), BLOCKING_POWER_W["a100"],
                                    options, ramp_s / 2, power_floor=True)
    assert capped.filler and capped.plans[plan].filler_energy_j > 0  # the cap needs a filler here
    assert frontier.plans[plan].energy == pytest.approx(switches[0]["plan_energy_j"])
    planned_w, reference_w = capped.plans[plan].swing_w, capped.reference_swing_w
    measured_w = summaries[0]["job"]["power_swing"]["peak_to_trough_w"]
    assert abs(measured_w - planned_w) <= SWING_TOLERANCE * reference_w, (measured_w, planned_w, reference_w)
    assert measured_w <= (SWING_CAP + SWING_TOLERANCE) * reference_w
    measured_j = sum(summary["deployed"]["energy_j"] for summary in summaries)  # per iteration, both GPUs
    assert measured_j == pytest.approx(switches[0]["plan_energy_j"], rel=MODEL_DISAGREEMENT), measured_j
