"""Zeus and Chase on the runtime: power-limit mode, cost policies on the frontier, agreement
across the ranks of a pipeline, emissions accounting.

Single-process tests drive `PerseusRuntime` like an adapter on a simulated A100 with a virtual
clock (`pace=0`). The multi-rank tests run this file as a script in two processes over gloo
(one 2-stage pipeline), and one short DeepSpeed job runs power-limit mode end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusConfig, PerseusRuntime, Phase
from runtime_helpers import make_config as base_config, run_gloo_job, sim_gpu, train

DEFAULT_LIMIT_W = 500.0  # the simulated A100's default (and maximum) power limit
LIMITS_W = [500.0, 400.0, 300.0, 200.0, 100.0]
WORKER_TIMEOUT_S = 120


def make_config(**overrides) -> PerseusConfig:
    return base_config(**{"warmup_iterations": 2, **overrides})


def power_limit_policy(eta: float) -> dict:
    return {"type": "zeus", "eta": eta, "mode": "power_limit",
            "power_limit": {"warmup_iters": 1, "profile_iters": 2, "step_w": 100}}


# --------------------------------------------------------------------------- power-limit mode
def run_power_limit(eta: float) -> tuple[PerseusRuntime, list[float]]:
    """A job without pipeline parallelism (1-stage schedule) in power-limit mode; returns the
    runtime (closed) and the GPU's power limit after every iteration."""
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(policy=power_limit_policy(eta)), schedule=build_schedule("1f1b", 1, 4),
                             stage=0, gpu=gpu)
    limits = []
    for _ in range(24):
        train(runtime, 1)
        limits.append(gpu.power_limit_w())
    assert gpu.clock_history == []  # power-limit mode never locks clocks
    runtime.close()
    return runtime, limits


@pytest.mark.distributed
def test_power_limit_mode_walks_the_limits_picks_one_and_restores_it():
    runtime, limits = run_power_limit(eta=0.5)
    gpu = runtime.gpu
    policy = runtime.summary()["policy"]
    assert policy["mode"] == "power_limit" and policy["profiling"] is False
    assert [m["limit_w"] for m in policy["measurements"]] == LIMITS_W  # max first, step 100 W
    assert all(m["num_gpus"] == 1 for m in policy["measurements"])
    chosen = policy["limit_w"]
    assert chosen in LIMITS_W
    # Warm-up at the default limit, then every candidate for 1 + 2 iterations, then the choice.
    # The optimizer sees each iteration's device record one iteration later (never waiting on
    # the device), so the first candidate runs one iteration longer.
    assert limits[:2] == [DEFAULT_LIMIT_W] * 2
    assert limits[2:3 + 3 * len(LIMITS_W)] == [LIMITS_W[0]] + [w for w in LIMITS_W for _ in range(3)][1:] + [chosen]
    assert set(limits[3 + 3 * len(LIMITS_W):]) == {chosen}
    assert policy["switches"][-1] == {"iteration": 17, "limit_w": chosen, "reason": "chosen"}
    last = runtime.history[-1]
    assert last.setting.describe() == f"limit {chosen:g} W" and last.phase.value == "power_limit"
    assert gpu.power_limit_w() == DEFAULT_LIMIT_W  # restored at close
    summary = runtime.summary()
    assert summary["deployed"]["iterations"] == 24 - 18  # at the chosen limit
    assert summary["energy_saving_vs_default"] is not None and summary["default_clocks"]["iterations"] == 1


@pytest.mark.distributed
def test_power_limit_eta_trades_time_for_energy():
    fast, _ = run_power_limit(eta=0.0)
    frugal, _ = run_power_limit(eta=1.0)
    fast_limit = fast.summary()["policy"]["limit_w"]
    frugal_limit = frugal.summary()["policy"]["limit_w"]
    assert fast_limit == DEFAULT_LIMIT_W  # eta 0: time only, the unthrottled limit
    assert frugal_limit < fast_limit
    measured = {m["limit_w"]: m for m in frugal.summary()["policy"]["measurements"]}
    assert measured[frugal_limit]["energy_j"] == min(m["energy_j"] for m in measured.values())
    assert measured[frugal_limit]["time_s"] > measured[fast_limit]["time_s"]


def test_power_limit_mode_in_dry_run_stays_at_the_default_limit(caplog):
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(policy=power_limit_policy(0.5), dry_run=True),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    train(runtime, 6)
    assert runtime.phase is Phase.OBSERVING
    assert "cannot set its GPU power limit" in caplog.text
    assert runtime.controller.dry_run_power_limits == [] and gpu.power_limit_w() == DEFAULT_LIMIT_W
    runtime.close()


def test_a_rank_that_falls_back_restores_its_limit_but_keeps_counting():
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(policy=power_limit_policy(1.0)), schedule=build_schedule("1f1b", 1, 4),
                             stage=0, gpu=gpu)
    train(runtime, 6)
    assert gpu.power_limit_w() == 400.0  # the second candidate
    runtime.fall_back("adapter cannot identify a computation")
    runtime.controller.flush()
    assert gpu.power_limit_w() == DEFAULT_LIMIT_W
    train(runtime, 14)
    assert gpu.power_limit_w() == DEFAULT_LIMIT_W  # later limits are not applied on this rank
    assert runtime.power_limit.optimizer.profiling is False  # but the optimizer (collective) went on
    runtime.close()


def test_power_limit_mode_rejects_a_frontier_policy_object():
    from perseus_ext.policies import StragglerPolicy

    with pytest.raises(ConfigError, match="perseus.policy.mode 'power_limit' picks a power limit"):
        PerseusRuntime(make_config(policy=power_limit_policy(0.5)), schedule=build_schedule("1f1b", 1, 4),
                       stage=0, gpu=sim_gpu(), policy=StragglerPolicy())


# --------------------------------------------------------------------------- Chase on the frontier
@pytest.mark.distributed
def test_chase_follows_a_carbon_trace_and_reports_emissions(tmp_path):
    trace = tmp_path / "grid.csv"
    # High intensity for the first 3 s of wall time, then a clean grid.
    trace.write_text("timestamp,carbon_intensity\n0,800\n3.0,50\n")
    policy = {"type": "chase", "eta": 0.9, "max_power_w": 400, "period_s": 0.05,
              "carbon": {"csv": str(trace), "align": "start"}}
    runtime = PerseusRuntime(make_config(policy=policy, straggler_check_interval=1000),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    train(runtime, 40)
    assert runtime.phase is Phase.DEPLOYED
    dirty = runtime.plan
    assert dirty.time > runtime.frontier.fastest.time  # dirty grid: energy is worth time
    deadline = time.monotonic() + 10.0
    while runtime.plan is dirty and time.monotonic() < deadline:
        train(runtime, 5, sleep_s=0.02)
    clean = runtime.plan
    assert clean.time < dirty.time and clean.energy > dirty.energy  # clean grid: speed up
    switch = runtime.deployment.switches[-1]
    assert switch.reason == "chase re-evaluated (period 0.05 s)"
    assert switch.iteration < 1000  # re-evaluated between straggler checks
    runtime.close()
    carbon = runtime.summary()["policy"]["carbon"]
    assert carbon["iterations"] == len(runtime.history)
    assert carbon["kg_emitted"] > 0 and carbon["kg_saved"] > 0
    assert "kgCO2 emitted" in carbon["summary"]
    # Accounted at the intensity in effect: no more than all energy at the trace's peak.
    assert carbon["kg_emitted"] < carbon["energy_j"] * 800 / 3.6e9


# --------------------------------------------------------------------------- two ranks, one pipeline
def _rank_dependent_intensity(now: float) -> float:
    """Each rank of the pipeline sees a different grid: only agreement makes them run one plan."""
    return 800.0 if os.environ["RANK"] == "0" else 50.0


def worker(out_dir: str) -> None:
    """One rank (= one stage of a 2-stage pipeline) of the multi-rank tests."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    profile = str(Path(out_dir) / "profile.csv")
    schedule = build_schedule("1f1b", 2, 4)
    cases = {
        "zeus_eta0": ({"type": "zeus", "eta": 0.0, "max_power_w": 400}, 20),  # profiles, saves
        "zeus_eta1": ({"type": "zeus", "eta": 1.0, "max_power_w": 400}, 8),  # same profile
        "chase_split": ({"type": "chase", "eta": 0.9, "max_power_w": 400,
                         "carbon": {"callback": _rank_dependent_intensity, "max_carbon": 800}}, 8),
        "power_limit": (power_limit_policy(0.5), 22),
    }
    results = {}
    for name, (policy, iterations) in cases.items():
        gpu = sim_gpu(seed=rank)
        runtime = PerseusRuntime(make_config(policy=policy, profile_path=profile), schedule=schedule,
                                 stage=rank, gpu=gpu)
        train(runtime, iterations, seed=rank)
        runtime.close()
        summary = runtime.summary()
        summary["plans"] = [[p.time, p.energy] for p in runtime.frontier.plans] if runtime.frontier else None
        summary["power_limit_after_close"] = gpu.power_limit_w()
        summary["clocks_restored"] = gpu.locked_clock is None
        results[name] = summary
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_job(__file__, tmp_path_factory.mktemp("two-ranks"), 2, WORKER_TIMEOUT_S)


def deployed_plan(summary: dict) -> int:
    return summary["plan_switches"][-1]["plan"]


@pytest.mark.distributed
def test_zeus_eta1_deploys_a_slower_plan_than_eta0_on_every_rank(two_ranks):
    eta0 = [r["zeus_eta0"] for r in two_ranks]
    eta1 = [r["zeus_eta1"] for r in two_ranks]
    assert eta1[0]["profiling_iterations"] == 0  # the saved profile: the very same frontier
    assert eta0[0]["plans"] == eta1[0]["plans"] == eta0[1]["plans"] == eta1[1]["plans"]
    assert {deployed_plan(s) for s in eta0} == {0}  # eta 0 = Perseus: the fastest plan
    slow = {deployed_plan(s) for s in eta1}
    assert len(slow) == 1 and slow != {0}  # one plan for the whole pipeline
    plans = eta0[0]["plans"]
    index = slow.pop()
    assert plans[index][0] > plans[0][0] and plans[index][1] == min(energy for _, energy in plans)
    for summary in eta0 + eta1:
        assert summary["final_phase"] == "deployed" and summary["clocks_restored"]


@pytest.mark.distributed
def test_pipeline_deploys_the_leaders_choice_when_ranks_read_different_carbon(two_ranks):
    chase = [r["chase_split"] for r in two_ranks]
    assert deployed_plan(chase[0]) == deployed_plan(chase[1]) != 0  # rank 0 (leader) sees 800
    # Each rank accounts its own GPU's emissions at the intensity it reads.
    assert all(s["policy"]["carbon"]["kg_emitted"] > 0 for s in chase)


@pytest.mark.distributed
def test_power_limit_mode_agrees_across_ranks_and_restores(two_ranks):
    runs = [r["power_limit"] for r in two_ranks]
    policies = [s["policy"] for s in runs]
    assert policies[0]["limit_w"] == policies[1]["limit_w"] is not None
    assert policies[0]["measurements"] == policies[1]["measurements"]  # one all-reduced view
    assert all(m["num_gpus"] == 2 for m in policies[0]["measurements"])
    assert [m["limit_w"] for m in policies[0]["measurements"]] == LIMITS_W
    for summary in runs:
        assert summary["power_limit_after_close"] == DEFAULT_LIMIT_W and summary["clocks_restored"]
        assert "frontier" not in summary and summary["plan_switches"] == []


# --------------------------------------------------------------------------- DeepSpeed
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency")
def test_deepspeed_power_limit_mode_end_to_end(tmp_path):
    from perseus_ext import demo

    scenario = demo.Scenario(
        out_dir=str(tmp_path), stages=2, pipelines=1, iterations=22, straggler_pipeline=None,
        variants=["perseus"], perseus={"policy": power_limit_policy(0.5)},
    )
    results = demo.launch(scenario, timeout_s=240)
    policies = []
    for (run,) in results:
        assert run["power_limit_w"] == DEFAULT_LIMIT_W and run["clocks_restored"]
        summary = run["summary"]
        assert summary["fallback_reason"] is None and summary["final_phase"] == "power_limit"
        policies.append(summary["policy"])
        phases = [r["phase"] for r in run["iterations"]]
        assert phases[:2] == ["warmup", "warmup"] and set(phases[2:]) == {"power_limit"}
    assert policies[0]["limit_w"] == policies[1]["limit_w"] in LIMITS_W
    assert [m["limit_w"] for m in policies[0]["measurements"]] == LIMITS_W
    assert all(m["num_gpus"] == 2 for m in policies[0]["measurements"])


if __name__ == "__main__":
    worker(sys.argv[1])
