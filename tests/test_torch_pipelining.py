"""End-to-end tests of perseus-ext on torch.distributed.pipelining's own schedule classes.

Real torch schedules (no re-implemented schedule), real torchrun processes over gloo, simulated
A100s: each job is the example's training (examples/torch_pipelining/train.py, run by
tests/torch_pipelining_worker.py, which injects faults and writes each rank's summary). Every
launch has a timeout, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_helpers import free_port

from perseus_ext.adapters.torch_pipelining_actions import RankLayout, first_mismatch
from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu.sim.workload import split_backward_s
from perseus_ext.measurement.gpu.sim import read_state_file
from perseus_ext.planning.schedule import Computation, Kind
from perseus_ext.torch_pipelining import SUPPORTED_CLASSES, read_config

pytestmark = [pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "torch_pipelining_worker.py"
LAUNCH_TIMEOUT_S = 240
MICROBATCHES = 4
# Four candidate clocks and an inline solve: profiling takes a handful of iterations, so a short
# job reaches the deployed phase with iterations left to run a plan.
FAST = {
    "enabled": True, "gpu": "sim:a100_sxm", "warmup_iterations": 1, "candidate_clocks": [1410, 1200, 990, 780],
    "solve_in_background": False, "straggler_check_interval": 3, "log_interval": 100,
    "solver": {"max_clock_changes_per_s": 0},  # 4-12 ms computations: no clock-change budget
    "simulated_workload": {"forward_seconds": [0.004, 0.006], "backward_seconds": [0.008, 0.012]},
}
INTERLEAVED_ITERATIONS = 13
SPLIT_BACKWARD = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# Profiling may take two rounds over the four clocks (8 iterations) after the first step and the
# warm-up: 14 steps leave a few deployed iterations either way.
SPLIT_BACKWARD_ITERATIONS = 14


@dataclass(frozen=True)
class Job:
    """One torchrun launch of the example: its output and each rank's result file."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict]
    directory: Path  # where the job ran (its config, result files and any saved profile)


def _start(tmp_path: Path, schedule: str, *, ranks: int = 2, iterations: int,
           extra: tuple[str, ...] = (), perseus: dict | None = None) -> tuple[subprocess.Popen, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "perseus.json"
    config.write_text(json.dumps({"perseus": {**FAST, **(perseus or {})}}), encoding="utf-8")
    out = tmp_path / "result"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), str(SCRIPT), "--config", str(config), "--schedule", schedule,
               "--microbatches", str(MICROBATCHES), "--iterations", str(iterations), "--result", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    return process, out


def _finish(process: subprocess.Popen, out: Path) -> Job:
    try:
        stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks, started in their own session
        stdout, stderr = process.communicate()
        raise AssertionError(f"the job did not finish within {LAUNCH_TIMEOUT_S} s:\n{stderr[-3000:]}") from None
    results = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(out.glob("rank-*.json"))]
    return Job(process.returncode, stdout, stderr, results, out.parent)


def _launch(tmp_path: Path, schedule: str, **options) -> tuple[Job, list[dict]]:
    job = _finish(*_start(tmp_path, schedule, **options))
    return job, job.results


@pytest.fixture(scope="module")
def short_jobs(tmp_path_factory) -> dict[str, Job]:
    """The jobs launched side by side: those that end after a step or two (mostly start-up) and
    the split-backward schedules' short deployments. Each split-backward job saves pipeline 0's
    measured profile to its directory's profile.csv."""
    root = tmp_path_factory.mktemp("short")
    launches = {name: _start(root / name, name, iterations=SPLIT_BACKWARD_ITERATIONS,
                             perseus={"profile_path": str(root / name / "profile.csv")})
                for name in SPLIT_BACKWARD}
    # One rank is enough to be refused (the class is checked before anything runs): the job
    # costs a process's start-up less.
    launches["unsupported"] = _start(root / "unsupported", "ScheduleGPipe", ranks=1, iterations=1)
    launches["disabled"] = _start(root / "disabled", "ScheduleInterleaved1F1B", iterations=INTERLEAVED_ITERATIONS,
                                  perseus={"enabled": False})
    launches["forged"] = _start(root / "forged", "ScheduleInterleaved1F1B", iterations=2,
                                extra=("--forge-pipeline-order",))
    return {name: _finish(*launch) for name, launch in launches.items()}


def _check_deployed(done: Job, results: list[dict], ranks: int, chunks: int, exited: bool) -> None:
    """Every rank deployed a plan, hooked every action of its last step (gradient syncs
    included) and plans the whole graph; `exited`: the job closed normally (the clocks were read
    back in the process)."""
    assert len(results) == ranks, done.stderr[-3000:]
    for result in results:
        summary = result["summary"]
        seen = summary["torch_pipelining"]
        assert summary["final_phase"] == "deployed", summary["fallback_reason"]
        assert summary["fallback_reason"] is None
        assert summary["deployed"]["iterations"] >= 2
        # Every action of the last step (the rank's graph order, its gradient syncs included)
        # ran between the runtime's hooks, i.e. at its planned clock.
        own_order = result["graph_orders"][summary["stage"]]
        assert seen["actions"] == len(own_order) > 0
        assert seen["hooked_actions"] == seen["actions"]
        assert result["planned_order"] == own_order and len(result["planned_clocks"]) == len(own_order)
        coverage = summary["clock_coverage"]["exact"]
        assert coverage is not None and 0.0 < coverage <= 1.0
        # The graph holds one gradient sync per model chunk; the runtime plans all of it.
        assert seen["gradient_syncs"] == chunks * 2  # both pipeline ranks' chunks
        assert seen["planned"] == seen["graph"]
        if exited:
            assert result["clocks_restored"] is True
        orders = result["graph_orders"]
        assert [sum(a.startswith("R") for a in order) for order in orders] == [chunks] * len(orders)


@pytest.fixture(scope="module")
def deploying_jobs(tmp_path_factory) -> dict[str, Job]:
    """The two-rank Schedule1F1B job that dies at step 15 and the ScheduleInterleaved1F1B job,
    launched side by side. The 1F1B job's simulated GPUs keep their state in its directory's
    gpu-state/gpu<rank>.json."""
    root = tmp_path_factory.mktemp("deploying")
    states = root / "1f1b" / "gpu-state"
    states.mkdir(parents=True)
    gpu = f"sim:a100_sxm?state_file={states}/gpu{{rank}}.json"
    launches = {
        "1f1b": _start(root / "1f1b", "Schedule1F1B", iterations=16, extra=("--raise-at", "15"), perseus={"gpu": gpu}),
        "interleaved": _start(root / "interleaved", "ScheduleInterleaved1F1B", iterations=INTERLEAVED_ITERATIONS),
    }
    return {name: _finish(*launch) for name, launch in launches.items()}


def test_1f1b_deploys_and_an_exception_exit_restores_the_clocks(deploying_jobs):
    """Schedule1F1B profiles, solves and deploys; the script then dies with an exception in its
    training loop, and interpreter exit restores the clocks (read back from the simulated GPUs'
    state files once the processes are gone)."""
    done = deploying_jobs["1f1b"]
    results, states = done.results, done.directory / "gpu-state"
    assert done.returncode != 0 and "InjectedFailure: injected failure before step 15" in done.stderr
    assert [r["failed_at"] for r in results] == [15, 15]
    _check_deployed(done, results, ranks=2, chunks=1, exited=False)
    assert [r["summary"]["torch_pipelining"]["actions"] for r in results] == [2 * MICROBATCHES + 1] * 2
    graph = results[0]["summary"]["torch_pipelining"]["graph"]
    assert graph == {"kind": "1f1b", "stages": 2, "microbatches": MICROBATCHES, "virtual_stages": 1}
    for rank in range(2):
        state = read_state_file(states / f"gpu{rank}.json")
        assert state["locked_sm_clock"] is None, state


def test_interleaved_1f1b_deploys_per_chunk_clocks_and_trains_the_same_model(deploying_jobs, short_jobs):
    done = deploying_jobs["interleaved"]
    results = done.results
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_deployed(done, results, ranks=2, chunks=2, exited=True)
    assert [r["summary"]["torch_pipelining"]["actions"] for r in results] == [4 * MICROBATCHES + 2] * 2
    graph = results[0]["summary"]["torch_pipelining"]["graph"]
    assert graph == {"kind": "interleaved", "stages": 2, "microbatches": MICROBATCHES, "virtual_stages": 2}
    # The looped layout comes from the stages: rank 0 holds stage_index 0 and 2, rank 1 holds 1 and 3.
    orders = results[0]["graph_orders"]
    assert {a for a in orders[0] if a.startswith("F")} == {f"F{m}{c}@s0" for m in range(MICROBATCHES) for c in ("", "c1")}
    # The same training without perseus-ext: bit-identical losses (the hooks change no math).
    twin = short_jobs["disabled"]
    assert twin.returncode == 0, twin.stderr[-3000:]
    assert [r["summary"]["torch_pipelining"]["graph"] for r in twin.results] == [None, None]
    losses = [r["losses"] for r in results if r["losses"]]
    assert len(losses) == 1 and len(losses[0]) == INTERLEAVED_ITERATIONS
    assert losses == [r["losses"] for r in twin.results if r["losses"]]


def test_a_straggling_pipeline_slows_the_other_one_on_four_ranks(tmp_path):
    """Two data-parallel pipelines of two stages; from iteration 13 on the second one's simulated
    GPUs run 40 % slower: the first pipeline's straggler checks (across the replicas of
    `dp_group`) measure it and move that pipeline off its fastest plan; the straggler itself
    keeps its fastest plan. One check confirms a
    straggler here (the default asks two in a row), so a run this short sees the response; the
    computations are twice the other tests' so that host noise on a crowded machine stays well
    below the slowdown."""
    done, results = _launch(tmp_path, "Schedule1F1B", ranks=4, iterations=28,
                            extra=("--data-parallel", "2", "--straggler", "13", "1.4"),
                            perseus={"straggler_confirmations": 1, "simulated_workload": {
                                "forward_seconds": [0.008, 0.012], "backward_seconds": [0.016, 0.024]}})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted((r["summary"]["pipeline"], r["summary"]["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        summary = result["summary"]
        assert summary["final_phase"] == "deployed", summary["fallback_reason"]
        assert summary["torch_pipelining"]["hooked_actions"] == 2 * MICROBATCHES + 1  # and the sync
        assert result["clocks_restored"] is True
        switches = summary["plan_switches"]
        assert switches and switches[0]["reason"] == "deploy" and switches[0]["iteration"] < 13
        if summary["pipeline"] == 0:
            # A straggler check of the first pipeline measured the second one as the slowest, by
            # about the injected slowdown, and switched plans on it (which plan the policy picks
            # for that deadline, a slowed or a wait-aware one, is the runtime's own choice).
            measured = [(float(m[1]) / float(m[2]), s) for s in switches if s["iteration"] >= 13
                        and (m := re.match(r"slowest pipeline ([0-9.]+) s, this one ([0-9.]+) s", s["reason"]))]
            assert measured and max(ratio for ratio, _ in measured) >= 1.2, switches
            assert any(s["factor"] > 1.0 or s["plan"] != 0 for s in switches[1:]), switches
        else:
            assert [(s["plan"], s["factor"]) for s in switches] == [(0, 1.0)], switches


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD)
def test_split_backward_schedules_profile_solve_and_deploy_input_and_weight_gradient_clocks(short_jobs, schedule):
    """The zero-bubble classes and DualPipeV are planned like 1F1B: every rank profiles a row per
    computation kind it runs (the input and weight gradients measured, not derived), the pipeline
    solves, every rank deploys, the I and W actions run at their planned clocks, and the clocks
    are restored at the end."""
    done = short_jobs[schedule]
    results = done.results
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ConfigError" not in done.stderr and "keeps the default GPU clocks" not in done.stdout + done.stderr
    _check_deployed(done, results, ranks=2, chunks=2, exited=True)
    for result in results:
        seen = result["summary"]["torch_pipelining"]
        assert seen["idle_reason"] is None
        assert seen["graph"]["kind"] == SUPPORTED_CLASSES[schedule].value
        assert seen["graph"]["virtual_stages"] == 2  # model chunks per rank
        # The rank's hooked actions include input- and weight-gradient ones.
        assert {"F", "I", "W"} <= {action[0] for action in result["graph_orders"][result["summary"]["stage"]]}
        assert result["summary"]["clock_coverage"]["exact"] > 0.0
    # The measured profile (saved by the pipeline's leader) has a row per kind each stage ran at
    # every profiled clock: F, I, W and the gradient sync everywhere, B only where the schedule
    # runs full backwards.
    with (done.directory / "profile.csv").open(encoding="utf-8") as rows:
        measured = {(int(row["stage"]), row["instruction"]) for row in csv.DictReader(rows)}
    ran = {(stage, kind) for stage, order in enumerate(results[0]["graph_orders"])
           for kind in {_KIND_OF[action[0]] for action in order}}
    assert measured == ran
    assert {kind for _, kind in ran} >= {"forward", "input_gradient", "weight_gradient", "reduce_grad"}


_KIND_OF = {"F": "forward", "B": "backward", "I": "input_gradient", "W": "weight_gradient", "R": "reduce_grad"}


def test_the_simulated_split_backward_shares_one_backward():
    """The simulated GPU's input and weight gradients add up to the configured backward and split
    it evenly (the planner's stated default: the two matrix products of a layer's backward)."""
    input_s, weight_s = split_backward_s([0.004, 0.006], [0.008, 0.012])
    assert input_s == pytest.approx([0.004, 0.006]) and weight_s == pytest.approx([0.004, 0.006])
    input_s, weight_s = split_backward_s([0.01], [0.03])
    assert [i + w for i, w in zip(input_s, weight_s)] == pytest.approx([0.03])


def test_an_unsupported_schedule_class_is_a_config_error_naming_it(short_jobs):
    done = short_jobs["unsupported"]
    results = done.results
    assert done.returncode != 0
    assert "ConfigError: perseus-ext does not support the torch.distributed.pipelining schedule class ScheduleGPipe" in done.stderr
    assert "Schedule1F1B" in done.stderr and results == []


def test_a_pipeline_order_that_differs_from_what_ran_is_a_config_error(short_jobs):
    done = short_jobs["forged"]
    results = done.results
    assert done.returncode != 0
    message = "executed another order than its pipeline_order: pipeline rank 0 ran F0@s0 at position 0"
    assert done.stderr.count(message) == 2, done.stderr[-3000:]  # every rank refuses, none hangs
    assert results == []


def test_config_is_validated_before_any_schedule_runs(tmp_path):
    with pytest.raises(ConfigError, match="warmup_iteratons"):
        read_config({"enabled": True, "warmup_iteratons": 1})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"not_perseus": {}}), encoding="utf-8")
    with pytest.raises(ConfigError, match="'perseus' object"):
        read_config(path)
    assert read_config({"enabled": True, "gpu": "sim:a100_sxm"}).enabled is True


def test_layout_places_looped_and_v_shaped_stages():
    looped = RankLayout.from_indices([[0, 2], [1, 3]])
    assert looped.placement == ((0, 0), (1, 0), (0, 1), (1, 1))
    v_shape = RankLayout.from_indices([[0, 3], [1, 2]])
    assert v_shape.placement == ((0, 0), (1, 0), (1, 1), (0, 1))
    with pytest.raises(ConfigError, match="stage_index"):
        RankLayout.from_indices([[0], [2]])


def test_mismatch_names_the_rank_and_position_and_ignores_unlisted_syncs():
    f0, b0 = Computation(0, 0, 0, Kind.FORWARD), Computation(0, 0, 0, Kind.BACKWARD)
    sync = Computation(0, 0, 0, Kind.REDUCE_GRAD)
    assert first_mismatch([[f0, b0, sync]], [[f0, b0]]) is None
    assert first_mismatch([[f0, b0, sync]], [[f0, b0, sync]]) is None
    message = first_mismatch([[f0, b0, sync]], [[b0, f0, sync]])
    assert message is not None and "pipeline rank 0 ran F0@s0 at position 0 where pipeline_order lists B0@s0" in message
