"""Megatron end to end: the tiny GPT of examples/megatron_gpt3 on megatron-core's real pipeline
schedules, CPU processes over gloo, one simulated A100 per rank.

The layouts that use the same number of processes share one torchrun job (`tests/megatron_layouts.py`:
megatron's import and the process group's start-up are paid once; each layout starts on a fresh
model-parallel state and keeps its own directory and output; the two-process job also trains
test_megatron_full_iteration.py's graphed run), and each layout trains several times in the
same processes: `--perseus` off, `--perseus --perseus-mode observe` (default clocks, measured:
the energy baseline, since nothing measures energy without the runtime) and `--perseus`
(profile, solve, deploy), plus a straggler or misplanned run. Energy per iteration is summed
over all ranks; iteration time is the slowest rank's. Medians over the steady iterations keep the
2-core machine's scheduling noise out of the comparison.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "megatron_gpt3" / "pretrain_gpt3.py"
LAUNCHER = ROOT / "tests" / "megatron_layouts.py"

TINY = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "1"]
ITERATIONS = 17
PERSEUS = {
    "gpu": "sim:a100_sxm?noise=0&period=0.01",  # a fine energy counter: per-iteration figures
    "warmup_iterations": 1,
    "candidate_clocks": [1410, 1200, 990],
    "profiling_iterations_per_clock": 2,  # one iteration disturbed by a busy CPU is outvoted
    "solve_in_background": False,  # deterministic: the plan is deployed at a known iteration
    "straggler_check_interval": 2,
    # The last stage also runs the LM head and loss, so it is the slower one: the first stage
    # has slack to spend at lower clocks (intrinsic energy bloat).
    "simulated_workload": {"forward_seconds": [0.02, 0.03], "backward_seconds": [0.04, 0.06]},
    # No clock-change budget: computations of 20-60 ms would leave one clock per stage under the
    # default 5 changes a second (docs/solver.md); these tests check per-computation plans.
    "solver": {"max_clock_changes_per_s": 0},
}
# Ranks 1 and 3 (pipeline 1 under PP=2 x DP=2) run 20 % slower: a straggling pipeline.
STRAGGLER_GPU = ["--perseus-gpu", PERSEUS["gpu"] + "&slowdown=1.2&slowdown_ranks=1,3"]
MAX_TIME_INCREASE = 0.01  # the issue's bound on the iteration-time cost of Perseus
# Wall-clock iteration times of runs minutes apart on 2 shared cores (load average ~6 while other
# test suites run) differ by up to ~2 % with no clock change at all, so the measured comparison
# gets that much slack on top; the planned time is held to the exact bound.
MEASUREMENT_NOISE = 0.02
MODEL_TOLERANCE = 0.05  # the deployed plan's model time against the devices' (the demo's model check)
# A shared job trains several layouts one after the other: the test that starts it waits for all.
pytestmark = [pytest.mark.timeout(900), pytest.mark.distributed]  # every test reads a torchrun job


@dataclass
class Run:
    """What one training run left behind: rank 0's metrics and every rank's iteration log."""

    name: str
    metrics: dict
    log: list[dict]
    ranks: int  # processes of the job: every one of them writes a summary

    @property
    def losses(self) -> list[float]:
        return [entry["loss"] for entry in self.metrics["iterations"]]

    @property
    def summaries(self) -> list[dict] | None:
        """Every rank's summary (None: a run without --perseus)."""
        summaries = self.metrics["perseus"]
        assert summaries is None or len(summaries) == self.ranks, f"{summaries} from {self.ranks} ranks"
        return summaries

    def per_iteration(self, phases: tuple[str, ...]) -> tuple[float, float, float]:
        """Over the iterations in `phases`: median whole-job energy (J), median and minimum time
        of the slowest rank (s). The minimum is the least disturbed by other processes."""
        by_iteration: dict[int, list[dict]] = {}
        for record in self.log:
            by_iteration.setdefault(record["iteration"], []).append(record)
        num_ranks = len(self.summaries)
        energies, times = [], []
        for iteration, records in sorted(by_iteration.items()):
            if iteration == 0 or len(records) != num_ranks:
                continue  # iteration 0 carries one-off allocation costs
            if all(r["phase"] in phases for r in records):
                energies.append(sum(r["energy_j"] for r in records))
                times.append(max(r["time_s"] for r in records))
        assert energies, f"{self.name}: no iterations in phases {phases}"
        return statistics.median(energies), statistics.median(times), min(times)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp: Path, nproc: int, layouts: dict[str, tuple[list[str], dict[str, dict]]],
           timeout: int) -> dict[str, dict]:
    """Train every layout's runs (layout name -> (parallel flags, runs); a run: name ->
    {"perseus": None | "observe" | "optimize", "env", "misplan", "cpu_graphs", "iterations",
    "argv"}) in one torchrun job of `nproc` CPU processes, layout after layout. Per layout: its
    runs (`Run`), its part of the job's output ("output") and its directory `tmp / layout`
    ("dir"), which holds its runs' files."""
    from megatron_layouts import split_output

    config = tmp / "perseus.json"
    config.write_text(json.dumps(PERSEUS))
    entries = []
    for layout_name, (layout, runs) in layouts.items():
        directory = tmp / layout_name
        directory.mkdir(exist_ok=True)
        for name, run in runs.items():
            argv = TINY + layout + run.get("argv", []) + [
                "--train-iters", str(run.get("iterations", ITERATIONS)),
                "--metrics-file", str(directory / f"{name}.json"),
            ]
            if run["perseus"] is not None:
                argv += ["--perseus", "--perseus-config", str(config), "--perseus-mode",
                         run["perseus"], "--perseus-log-path", str(directory / f"{name}-{{rank}}.jsonl")]
            entries.append({"group": layout_name, "argv": argv, "env": run.get("env", {}),
                            "misplan": run.get("misplan", False), "cpu_graphs": run.get("cpu_graphs", False)})
    runs_file = tmp / "runs.json"
    runs_file.write_text(json.dumps(entries))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("PERSEUS_GPU", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(LAUNCHER), str(runs_file), str(SCRIPT),
    ]
    try:
        result = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"megatron run timed out after {timeout} s:\n{(expired.stdout or '')[-4000:]}")
    (tmp / "output.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    names = list(layouts)
    stdout, stderr = split_output(result.stdout, names), split_output(result.stderr, names)
    done = {}
    for layout_name, (_, runs) in layouts.items():
        directory = tmp / layout_name
        done[layout_name] = {"output": stdout[layout_name] + stderr[layout_name], "dir": directory}
        for name in runs:
            log = []
            for path in sorted(directory.glob(f"{name}-*.jsonl")):
                log += [json.loads(line) for line in path.read_text().splitlines()]
            done[layout_name][name] = Run(name, json.loads((directory / f"{name}.json").read_text()), log, nproc)
    return done


def check_energy_drops_time_holds_losses_equal(runs: dict[str, Run]) -> dict[str, float]:
    off, observe, optimize = runs["off"], runs["observe"], runs["optimize"]
    assert off.summaries is None
    for summary in optimize.summaries:
        assert summary["fallback_reason"] is None
        assert summary["profiling_iterations"] >= 2  # profiling completed ...
        assert summary["final_phase"] == "deployed"  # ... and a plan was deployed
        assert summary["frontier"]["intrinsic_saving"] > 0
    for summary in observe.summaries:
        assert summary["final_phase"] == "observing" and summary["profiling_iterations"] == 0
    # The training math is untouched: same losses, bit for bit, with and without Perseus.
    assert optimize.losses == off.losses
    assert observe.losses == off.losses[: len(observe.losses)]

    baseline_energy, baseline_time, baseline_fastest = observe.per_iteration(("observing",))
    deployed_energy, deployed_time, deployed_fastest = optimize.per_iteration(("deployed",))
    frontier = optimize.summaries[0]["frontier"]
    figures = {
        "baseline_energy_j": baseline_energy, "deployed_energy_j": deployed_energy,
        "baseline_time_s": baseline_time, "deployed_time_s": deployed_time,
        "energy_saving": 1 - deployed_energy / baseline_energy,
        "time_change": deployed_time / baseline_time - 1,
        "fastest_iteration_change": deployed_fastest / baseline_fastest - 1,
        "planned_time_change": frontier["fastest"]["time_s"] / frontier["all_max_clock"]["time_s"] - 1,
    }
    print(json.dumps(figures))
    assert deployed_energy < baseline_energy * 0.97, figures
    assert figures["planned_time_change"] <= MAX_TIME_INCREASE, figures
    assert figures["fastest_iteration_change"] <= MAX_TIME_INCREASE + MEASUREMENT_NOISE, figures
    assert figures["time_change"] <= MAX_TIME_INCREASE + MEASUREMENT_NOISE, figures  # the median iteration too
    # The model check: the fastest plan's model time against pipeline 0's first stage's compute
    # time on the devices (its last computation ends the pipeline's).
    at_plan = [r["compute_s"] for r in optimize.log
               if r["phase"] == "deployed" and r["plan"] == 0 and r["pipeline"] == 0 and r["stage"] == 0]
    assert at_plan
    model_error = statistics.median(at_plan) / frontier["fastest"]["time_s"] - 1
    assert abs(model_error) <= MODEL_TOLERANCE, (model_error, frontier["fastest"])
    return figures


# ----------------------------------------------------------------------------- the jobs
_SHARED_JOBS: dict[Path, dict[str, dict]] = {}  # the session's base temporary directory -> its job


def shared_two_process_job(tmp_path_factory) -> dict[str, dict]:
    """PP=2 (with test_megatron_full_iteration.py's full-iteration CUDA graph run), PP=2 with a
    batch-size ramp-up, interleaved PP=2 x VPP=2 and PP=1 (DP=2): one job per test session,
    whichever of the two files asks first."""
    session = tmp_path_factory.getbasetemp()
    if session not in _SHARED_JOBS:
        tmp = tmp_path_factory.mktemp("megatron_2_processes")
        _SHARED_JOBS[session] = launch(tmp, 2, {"pp2": pp2_layout(tmp / "pp2"), "rampup": RAMPUP,
                                                "interleaved": INTERLEAVED, "no_pipeline": no_pipeline_layout()},
                                       timeout=600)
    return _SHARED_JOBS[session]


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory) -> dict[str, dict]:
    return shared_two_process_job(tmp_path_factory)


@pytest.fixture(scope="module")
def four_process_job(tmp_path_factory) -> dict[str, dict]:
    """PP=2 x DP=2 and interleaved PP=2 x VPP=2 x DP=2."""
    tmp = tmp_path_factory.mktemp("megatron_4_processes")
    return launch(tmp, 4, {"pp2_dp2": PP2_DP2, "interleaved_dp2": INTERLEAVED_DP2}, timeout=500)


# ----------------------------------------------------------------------------- PP=2
def pp2_layout(directory: Path) -> tuple[list[str], dict[str, dict]]:
    profile = str(directory / "profile.csv")
    return ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], {
        "off": {"perseus": None},
        "observe": {"perseus": "observe", "iterations": 10},
        # Also saves its measured profile: the full-iteration graphed run below solves from it.
        "optimize": {"perseus": "optimize", "argv": ["--perseus-profile-path", profile]},
        "misplanned": {"perseus": "optimize", "misplan": True, "iterations": 4},
        # As a Megatron user watches a run: the example's --tensorboard-dir (the last rank's
        # SummaryWriter), with baseline probes for a measured saving.
        "monitored": {"perseus": "optimize", "iterations": 24,
                      "argv": ["--tensorboard-dir", str(directory / "tensorboard"), "--perseus-baseline-fraction", "0.25"]},
        # test_megatron_full_iteration.py's claims.
        "graphed": {"perseus": "optimize", "iterations": GRAPHED_ITERATIONS, "cpu_graphs": True, "argv": [
            "--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", str(GRAPHED_WARMUP_STEPS),
            "--perseus-profile-path", profile, "--perseus-frontier-path", str(directory / "frontier.json")]},
    }


GRAPHED_ITERATIONS = 12
GRAPHED_WARMUP_STEPS = 2


@pytest.fixture(scope="module")
def pp2(two_process_job) -> dict[str, Run]:
    return two_process_job["pp2"]


def test_pp2_perseus_saves_energy_at_the_same_speed(pp2):
    check_energy_drops_time_holds_losses_equal(pp2)


def test_pp2_schedule_mismatch_logs_one_error_and_falls_back(pp2):
    """A plan whose order differs from what megatron-core runs: one clear error per rank,
    default clocks, training unaffected."""
    misplanned = pp2["misplanned"]
    assert misplanned.losses == pp2["off"].losses[: len(misplanned.losses)]
    for summary in misplanned.summaries:
        assert "schedule expects" in summary["fallback_reason"]
        assert summary["final_phase"] != "deployed"
    errors = [line for line in pp2["output"].splitlines() if "runs at default clocks from now on" in line]
    assert len(errors) == 2, errors  # exactly one per rank


def test_pp2_tensorboard_gets_the_perseus_metrics_and_the_job_figure_is_the_reports(pp2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from perseus_ext.observability.log_files import read_logs
    from perseus_ext.observability.reporting import analyse
    from perseus_ext.observability.summary_text import job_line

    run = pp2["monitored"]
    events = EventAccumulator(str(pp2["dir"] / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert [step for step, _ in scalars["lm loss"]] == list(range(24))
    assert [step for step, _ in scalars["perseus/energy_per_iteration_j"]] == list(range(24))  # none lost at close
    assert all(value > 0 for _, value in scalars["perseus/energy_per_iteration_j"] + scalars["perseus/time_per_iteration_s"])
    phases = [value for _, value in scalars["perseus/phase"]]
    assert phases == sorted(phases) and phases[0] == 0 and phases[-1] == 3  # warm-up, profiling, solving, deployed
    assert 1 in phases and 2 in phases
    deployed = {step for step, value in scalars["perseus/phase"] if value == 3}
    coverage = dict(scalars["perseus/clock_coverage"])
    plans = dict(scalars["perseus/plan"])
    probes = {step for step, value in scalars["perseus/baseline_probe"] if value == 1}
    assert probes and probes < deployed
    assert {step for step in deployed if plans[step] >= 0} == deployed - probes
    assert set(coverage) == deployed - probes and all(0 <= value <= 1 for value in coverage.values())
    factors = {step: value for step, value in scalars["perseus/straggler_factor"] if step in deployed}
    assert set(factors) == deployed and set(factors.values()) == {1.0}
    low, high = scalars["perseus/saving_low"][-1][1], scalars["perseus/saving_high"][-1][1]
    assert low < scalars["perseus/saving"][-1][1] < high
    # The last rank's writer has the last rank's figures: its log's records, step by step.
    last = {r["iteration"]: r["energy_j"] for r in run.log if r["rank"] == 1}
    assert dict(scalars["perseus/energy_per_iteration_j"]) == pytest.approx(last, rel=1e-6)  # float32 events

    job = run.summaries[0]["job"]
    assert all(summary["job"] == job for summary in run.summaries)
    report = analyse(read_logs(sorted(pp2["dir"].glob("monitored-*.jsonl"))))["job"]
    assert job["iterations"] == report["iterations"] == 24
    assert job["measured"] == report["measured"] and job["phase_costs"] == report["phase_costs"]
    assert job["measured"]["all"]["probes"] >= 2
    assert job_line(job) in pp2["output"]
    observe = pp2["observe"].summaries[0]["job"]
    assert observe["default_per_iteration"]["energy_j"] > 0
    assert job_line(observe) in pp2["output"] and "observe mode at default clocks: energy/iteration" in job_line(observe)


# ----------------------------------------------------------------------------- PP=2 x DP=2
# Megatron's rank order is tp-cp-ep-dp-pp: ranks 0,1 are stage 0 of pipelines 0,1 and ranks
# 2,3 their stage 1, so pipeline 1 = ranks 1 and 3.
PP2_DP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], {
    "off": {"perseus": None},
    "observe": {"perseus": "observe", "iterations": 10},
    "optimize": {"perseus": "optimize"},
    # Long enough for several slowed iterations even when a loaded machine delays the checks
    # that confirm the straggler: their median is what the test compares.
    "straggler": {"perseus": "optimize", "argv": STRAGGLER_GPU, "iterations": 21},
}


@pytest.fixture(scope="module")
def pp2_dp2(four_process_job) -> dict[str, Run]:
    return four_process_job["pp2_dp2"]


def test_pp2_dp2_perseus_saves_energy_at_the_same_speed(pp2_dp2):
    check_energy_drops_time_holds_losses_equal(pp2_dp2)
    pipelines = {(s["pipeline"], s["stage"]) for s in pp2_dp2["optimize"].summaries}
    assert pipelines == {(0, 0), (0, 1), (1, 0), (1, 1)}  # the DP group maps to pipelines


def test_pp2_dp2_straggler_slows_the_other_pipeline_to_match(pp2_dp2):
    run = pp2_dp2["straggler"]
    by_pipeline: dict[int, list[dict]] = {}
    for summary in run.summaries:
        by_pipeline.setdefault(summary["pipeline"], []).append(summary)
    fast, slow = by_pipeline[0], by_pipeline[1]
    for summary in fast:
        switches = [s for s in summary["plan_switches"] if s["reason"] != "deploy"]
        assert switches, summary["plan_switches"]
        assert switches[-1]["factor"] > 1.05  # moved to a slower, cheaper plan
        assert switches[-1]["plan_energy_j"] < summary["plan_switches"][0]["plan_energy_j"]
        assert summary["deployed_extrinsic"] is not None
    for summary in slow:  # the straggler itself keeps its fastest plan
        assert all(s["factor"] == 1.0 for s in summary["plan_switches"]), summary["plan_switches"]
    # The slowed pipeline now computes in about the straggler's time, and spends less energy.
    fast_records = [r for r in run.log if r["pipeline"] == 0 and r["phase"] == "deployed"]
    slow_records = [r for r in run.log if r["pipeline"] == 1 and r["phase"] == "deployed"]
    fast_compute = statistics.median(r["compute_s"] for r in fast_records if r["factor"] > 1.0)
    slow_compute = statistics.median(r["compute_s"] for r in slow_records)
    print(json.dumps({"fast_pipeline_compute_s": fast_compute, "straggler_compute_s": slow_compute}))
    assert fast_compute == pytest.approx(slow_compute, rel=0.06)
    intrinsic = [r["energy_j"] for r in fast_records if r["factor"] == 1.0]
    extrinsic = [r["energy_j"] for r in fast_records if r["factor"] > 1.0]
    # Deployed at the fastest plan first, slowed once two checks confirmed the straggler.
    assert intrinsic and extrinsic, [r["factor"] for r in fast_records]
    assert statistics.median(extrinsic) < statistics.median(intrinsic)


# ----------------------------------------------------------------------------- interleaved
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
               "--global-batch-size", "4"], {
    "off": {"perseus": None},
    "observe": {"perseus": "observe", "iterations": 10},
    "optimize": {"perseus": "optimize"},
}


@pytest.fixture(scope="module")
def interleaved(two_process_job) -> dict[str, Run]:
    return two_process_job["interleaved"]


def test_interleaved_perseus_saves_energy_at_the_same_speed(interleaved):
    check_energy_drops_time_holds_losses_equal(interleaved)
    for summary in interleaved["optimize"].summaries:
        assert summary["megatron"]["schedule"] == {
            "kind": "interleaved", "stages": 2, "microbatches": 4, "virtual_stages": 2,
        }


def pipeline_compute_s(run: Run, pipeline: int, keep) -> float:
    """Median over deployed iterations (those `keep(record)` accepts on every stage) of the
    pipeline's compute time: its slowest stage's, as the frontier models the iteration."""
    by_iteration: dict[int, list[dict]] = {}
    for record in run.log:
        if record["pipeline"] == pipeline and record["phase"] == "deployed":
            by_iteration.setdefault(record["iteration"], []).append(record)
    stages = {s["stage"] for s in run.summaries if s["pipeline"] == pipeline}
    times = [max(r["compute_s"] for r in records) for records in by_iteration.values()
             if len(records) == len(stages) and all(keep(r) for r in records)]
    assert times, f"{run.name}: no deployed iterations of pipeline {pipeline}"
    return statistics.median(times)


# ----------------------------------------------------------------------------- interleaved x DP=2
INTERLEAVED_DP2 = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                   "--global-batch-size", "8"], {"straggler": {"perseus": "optimize", "argv": STRAGGLER_GPU}}


@pytest.fixture(scope="module")
def interleaved_dp2(four_process_job) -> dict[str, Run]:
    return four_process_job["interleaved_dp2"]


def test_interleaved_model_matches_the_measured_iteration(interleaved_dp2):
    """The online profile times one chunk's computation; the planner must not divide it by the
    number of chunks again: the deployed fastest plan's modelled iteration is what the healthy
    pipeline measures (and no model-disagreement warning is logged)."""
    run = interleaved_dp2["straggler"]
    modelled = run.summaries[0]["frontier"]["fastest"]["time_s"]
    measured = pipeline_compute_s(run, 0, lambda record: record["factor"] == 1.0)
    print(json.dumps({"modelled_s": modelled, "measured_s": measured}))
    assert measured == pytest.approx(modelled, rel=0.05)
    assert "the frontier models" not in interleaved_dp2["output"]


def test_interleaved_straggler_slows_the_healthy_pipeline_just_enough(interleaved_dp2):
    run = interleaved_dp2["straggler"]
    for summary in run.summaries:
        assert summary["fallback_reason"] is None
        factors = [s["factor"] for s in summary["plan_switches"]]
        if summary["pipeline"] == 0:
            assert 1.1 < factors[-1] < 1.3, summary["plan_switches"]  # 1.2x straggler, not V x 1.2
        else:
            assert set(factors) == {1.0}
    fast = pipeline_compute_s(run, 0, lambda record: record["factor"] > 1.0)
    slow = pipeline_compute_s(run, 1, lambda record: True)
    print(json.dumps({"fast_pipeline_compute_s": fast, "straggler_compute_s": slow}))
    assert fast == pytest.approx(slow, rel=0.06)


# ----------------------------------------------------------------------------- batch-size ramp-up
# PP=2, 2 microbatches for 11 iterations (deployed from iteration 8 on: warm-up, 3 clocks x 2
# profiling iterations, the solve), then 4.
RAMPUP_ITERATIONS, RAMPED_AT = 15, 11
RAMPUP = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
          "--rampup-batch-size", "2", "2", str(2 * RAMPED_AT)], {
    "off": {"perseus": None, "iterations": RAMPUP_ITERATIONS},
    "optimize": {"perseus": "optimize", "iterations": RAMPUP_ITERATIONS},
}


@pytest.fixture(scope="module")
def rampup(two_process_job) -> dict[str, Run]:
    return two_process_job["rampup"]


def test_a_new_number_of_microbatches_is_planned_anew(rampup):
    run = rampup["optimize"]
    microbatches = [entry["microbatches"] for entry in run.metrics["iterations"]]
    assert microbatches == [2] * RAMPED_AT + [4] * (RAMPUP_ITERATIONS - RAMPED_AT)
    assert run.losses == rampup["off"].losses
    for summary in run.summaries:
        assert summary["fallback_reason"] is None
        assert summary["final_phase"] == "deployed"
        assert summary["megatron"]["schedule"]["microbatches"] == 4
    phases = {r["iteration"]: r["phase"] for r in run.log if r["stage"] == 0}
    assert phases[RAMPED_AT - 1] == "deployed" and phases[RAMPED_AT] == "solving"  # re-solved for 4 microbatches
    assert all(phases[i] == "deployed" for i in range(RAMPED_AT + 1, RAMPUP_ITERATIONS))
    assert "re-planning" in rampup["output"]


# ----------------------------------------------------------------------------- PP=1
def no_pipeline_layout() -> tuple[list[str], dict[str, dict]]:
    power_limit = {"type": "zeus", "mode": "power_limit",
                   "power_limit": {"warmup_iters": 0, "profile_iters": 1, "step_w": 100}}
    one_stage = ["--perseus-simulated-workload", '{"forward_seconds": 0.02, "backward_seconds": 0.04}']
    return ["--pipeline-model-parallel-size", "1", "--global-batch-size", "4"], {
        "observe": {"perseus": "observe", "iterations": 6, "argv": one_stage},
        "power_limit": {"perseus": "optimize", "iterations": 12,
                        "argv": one_stage + ["--perseus-policy", json.dumps(power_limit)]},
    }


@pytest.fixture(scope="module")
def no_pipeline(two_process_job) -> dict[str, Run]:
    return two_process_job["no_pipeline"]


def test_no_pipeline_observe_and_power_limit_modes_run(no_pipeline):
    """megatron-core's forward_backward_no_pipelining: observe measures every iteration,
    power-limit mode steps the limit down and settles on one."""
    observe, limited = no_pipeline["observe"], no_pipeline["power_limit"]
    for summary in observe.summaries:
        assert summary["fallback_reason"] is None and summary["final_phase"] == "observing"
        assert summary["megatron"]["schedule"] == {"kind": "1f1b", "stages": 1, "microbatches": 2,
                                                   "virtual_stages": 1}
    assert len([r for r in observe.log if r["phase"] == "observing"]) == 2 * 6
    for summary in limited.summaries:
        assert summary["fallback_reason"] is None and summary["final_phase"] == "power_limit"
        assert summary["policy"]["limit_w"] is not None
        assert len(summary["policy"]["measurements"]) >= 2
