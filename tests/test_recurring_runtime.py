"""The recurring-job collaborator inside one rank's runtime (single process, paced simulated A100):
early stop at an iteration boundary with clocks restored, crash expiry, the report at close,
the DeepSpeed batch keys, and the power-budget policy built from the config."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime_helpers import make_config, sim_gpu, train
from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.policies import PerseusEarlyStop
from perseus_ext.policies.batch_size import BatchSizeOptimizer, RunOutcome, read_states
from perseus_ext.runtime import PerseusConfig, PerseusRuntime
from perseus_ext.runtime.recurring import JobCoordinator, choose_batch_size

JOB = "unit-job"


def recurring_config(store: Path, **batch_size):
    options = {"store": str(store), "job_id": JOB, "batch_sizes": [4, 8], "default_batch_size": 8,
               "target_metric": {"name": "val_loss", "value": 1.0, "higher_is_better": False}, **batch_size}
    return make_config(gpu="sim:a100_sxm", policy={"max_power_w": 400, "batch_size": options})


def runtime_for(config) -> PerseusRuntime:
    prepared = choose_batch_size(config, num_gpus=1)
    return PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 2), stage=0, gpu=sim_gpu(),
                          prepared_run=prepared)


def seed_cheap_run(store: Path) -> None:
    """A reached run of batch size 8 so cheap that the next run's cost limit is tiny."""
    optimizer = BatchSizeOptimizer(store, JOB, [4, 8], 8, eta=0.5, max_power_w=400)
    run = optimizer.suggest()
    optimizer.report(run.run_id, 0.01, 1.0, outcome=RunOutcome.REACHED)
    optimizer.close()


def only_state(store: Path):
    (state,) = read_states(store, JOB)
    return state


def test_cost_limit_stops_every_rank_at_a_boundary_with_clocks_restored(tmp_path):
    store = tmp_path / "bso.db"
    seed_cheap_run(store)
    runtime = runtime_for(recurring_config(store))
    assert runtime.job.batch_size == 4 and runtime.job.assignment.cost_limit == pytest.approx(2 * 0.5 * (1 + 400 * 0.01))
    with pytest.raises(PerseusEarlyStop) as stopped:
        train(runtime, 50)
    assert stopped.value.batch_size == 4 and stopped.value.cost > stopped.value.cost_limit
    assert runtime.stop_requested and runtime._closed
    assert runtime.gpu.locked_clock is None  # restored before the exception reached the script
    assert runtime.iteration == 2  # decided at the first boundary, acted on at the next
    assert runtime.job.report.outcome is RunOutcome.STOPPED
    assert only_state(store).arms[4].stopped == 1


def test_reaching_the_target_before_a_decided_stop_takes_effect_wins_on_every_rank(tmp_path):
    """Rank 0 decides the stop at one boundary and acts at the next; a target reported in
    between must get the same answer on every rank (a rank that breaks out of its loop on
    True while another trains on would hang the job), so the run counts as reached."""
    store = tmp_path / "bso.db"
    seed_cheap_run(store)
    runtime = runtime_for(recurring_config(store))
    train(runtime, 1)  # the cost limit is passed here: stop decided, not yet taken
    assert not runtime.stop_requested
    assert runtime.report_metric(0.5)
    train(runtime, 2)  # no PerseusEarlyStop after the target
    runtime.close()
    assert runtime.job.report.outcome is RunOutcome.REACHED
    assert only_state(store).arms[4].reached == 1


def test_a_run_ending_without_its_target_is_not_reached_and_reaching_it_is_recorded(tmp_path):
    store = tmp_path / "bso.db"
    missed = runtime_for(recurring_config(store))
    train(missed, 3)
    assert not missed.report_metric(2.0)
    missed.close()
    assert missed.job.report.outcome is RunOutcome.NOT_REACHED
    assert missed.job.report.energy_j > 0 and missed.job.report.time_s > 0
    reached = runtime_for(recurring_config(store))
    train(reached, 3)
    assert reached.report_metric(0.9)
    reached.close()
    state = only_state(store)
    assert state.arms[8].not_reached == 1 and state.arms[4].reached == 1


def test_a_run_whose_script_dies_expires_at_once(tmp_path, capsys):
    store = tmp_path / "bso.db"
    runtime = runtime_for(recurring_config(store))
    train(runtime, 2)
    try:
        raise RuntimeError("the training script failed")
    except RuntimeError as err:
        sys.excepthook(type(err), err, err.__traceback__)  # what Python does before exiting
    runtime.close()  # the exit-time close must not report it as "not reached"
    arm = only_state(store).arms[8]
    assert arm.expired == 1 and not arm.costs
    assert "the training script failed" in capsys.readouterr().err


def test_batch_size_without_a_run_from_the_store_is_an_error(tmp_path):
    config = recurring_config(tmp_path / "bso.db")
    with pytest.raises(ConfigError, match="got no batch size from the store before its engine was built"):
        PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 2), stage=0, gpu=sim_gpu())


def test_report_metric_needs_a_target(tmp_path):
    options = {"store": str(tmp_path / "bso.db"), "job_id": JOB, "batch_sizes": [4, 8], "default_batch_size": 8}
    runtime = runtime_for(make_config(gpu="sim:a100_sxm", policy={"max_power_w": 400, "batch_size": options}))
    with pytest.raises(ConfigError, match="report_metric needs perseus.policy.batch_size.target_metric"):
        runtime.report_metric(1.0)
    runtime.close()


# --------------------------------------------------------------------------- DeepSpeed batch keys
def test_deepspeed_keeps_the_micro_batch_and_changes_gradient_accumulation():
    from perseus_ext.adapters.deepspeed import batch_keys_for

    keys, change = batch_keys_for({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, 64, 4)
    assert keys == {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}
    assert change.startswith("gradient_accumulation_steps 1 -> 8 (train_micro_batch_size_per_gpu 2 x data-parallel 4 kept)")
    derived, _ = batch_keys_for({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 16, 2)
    assert derived["train_micro_batch_size_per_gpu"] == 4 and derived["gradient_accumulation_steps"] == 2
    with pytest.raises(ConfigError, match="batch size 12 is not a multiple of train_micro_batch_size_per_gpu 2 x "
                                          "data-parallel size 4 = 8"):
        batch_keys_for({"train_micro_batch_size_per_gpu": 2}, 12, 4)
    with pytest.raises(ConfigError, match="set train_micro_batch_size_per_gpu"):
        batch_keys_for({"train_batch_size": 32}, 16, 2)


def test_deepspeed_initialize_refuses_candidates_that_cannot_be_built(tmp_path):
    from perseus_ext.adapters.deepspeed import with_run_batch_size

    section = {"enabled": True, "policy": {"max_power_w": 400, "batch_size": {
        "store": str(tmp_path / "bso.db"), "job_id": JOB, "batch_sizes": [6, 8], "default_batch_size": 8}}}
    model = SimpleNamespace(_topo=SimpleNamespace(get_dim=lambda axis: 2, world_size=lambda: 4))
    config = {"train_micro_batch_size_per_gpu": 2, "perseus": section}
    with pytest.raises(ConfigError, match="batch size 6 is not a multiple"):
        with_run_batch_size((), {"model": model, "config": config}, PerseusConfig.from_dict(section))
    assert not (tmp_path / "bso.db").exists()  # refused before the store was asked
    untouched = {"model": model, "config": {"perseus": {"enabled": True}}}
    assert with_run_batch_size((), untouched, PerseusConfig.from_dict({"enabled": True})) == ((), untouched, None)


# --------------------------------------------------------------------------- power budget
def test_power_budget_policy_from_the_config_divides_a_job_budget_over_the_gpus():
    from perseus_ext.config.policy import BudgetScope, PolicySection
    from perseus_ext.policies.factories import build_policy
    from perseus_ext.policies.power_budget import PowerBudgetPolicy
    from perseus_ext.runtime.comm import ControlPlane

    config = make_config(policy={"type": "power_budget", "budget": {"watts": 600, "scope": "job"}})
    policy = build_policy(config.policy)
    assert isinstance(policy, PowerBudgetPolicy) and policy.budget.scope is BudgetScope.JOB
    comm = ControlPlane(stage=0)
    comm.members = comm.members * 3  # what a 3-GPU job's control plane lists
    assert JobCoordinator.create(config, comm, None, policy) is None  # nothing to exchange
    assert policy.budget.per_gpu_w() == pytest.approx(200.0)
    for section, message in (
        ({"type": "power_budget"}, "perseus.policy.budget needs exactly one source for type 'power_budget'"),
        ({"type": "power_budget", "budget": {"watts": 300, "csv": "b.csv"}}, "needs exactly one source"),
        ({"type": "zeus", "budget": {"watts": 300}}, "perseus.policy.budget is only used by"),
        ({"type": "power_budget", "budget": {"watts": 300, "scope": "rack"}}, "perseus.policy.budget.scope"),
        ({"type": "power_budget", "mode": "power_limit", "budget": {"watts": 300}}, "needs perseus.policy.type 'zeus'"),
    ):
        with pytest.raises(ConfigError, match=message):
            PolicySection.parse(section)


BUDGET_W = {"now": 1000.0}


def budget_now(now: float) -> float:
    """The facility's budget (a callback source, changed by the test while the job runs)."""
    return BUDGET_W["now"]


def test_runtime_follows_a_changing_power_budget_within_one_period():
    BUDGET_W["now"] = 1000.0
    config = make_config(gpu="sim:a100_sxm", policy={
        "type": "power_budget", "period_s": 0.05,
        "budget": {"callback": "test_recurring_runtime:budget_now", "scope": "gpu"}})
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    try:
        for _ in range(60):
            train(runtime, 1)
            if runtime.deployment is not None:
                break
        assert runtime.deployment is not None, "no plan deployed"
        fastest = runtime.plan
        assert runtime.policy.last.fits and fastest is runtime.frontier.plans[0]
        low = runtime.frontier.min_energy
        BUDGET_W["now"] = low.energy / low.time * 1.001  # only the minimum-energy end fits
        changed_at = runtime.iteration
        train(runtime, 8, sleep_s=0.02)
        switch = runtime.deployment.switches[-1]
        assert runtime.plan is not fastest and runtime.policy.last.fits
        assert runtime.policy.last.average_power_w <= BUDGET_W["now"] * (1 + 1e-9)
        # the budget is re-read every period_s (0.05 s: about 2 iterations here)
        assert switch.iteration - changed_at <= 4 and "power_budget re-evaluated" in switch.reason
    finally:
        runtime.close()


def test_a_store_rank_0_cannot_use_fails_the_run_instead_of_guessing():
    from perseus_ext.runtime.recurring import choose_batch_size as choose

    options = {"store": "postgresql://nobody@127.0.0.1:1/bso", "job_id": JOB, "batch_sizes": [4, 8],
               "default_batch_size": 8}
    config = make_config(policy={"max_power_w": 400, "batch_size": options})
    with pytest.raises(ConfigError, match="rank 0 could not get this run's batch size from the store"):
        choose(config, num_gpus=1)


class _FakePlane:
    """A control plane seen from global rank 1 of a 2-rank job; its all-reduce returns what
    rank 0 would have contributed (a budget reading of 250 W)."""

    distributed = True
    rank = 1

    def __init__(self):
        self.members = [None, None]
        self.sent: list[list[float]] = []

    def all_sum(self, values):
        self.sent.append(list(values))
        return [0.0, 0.0, 0.0, 0.0, 250.0]


def test_only_rank_0_polls_a_url_budget_the_others_are_fed_its_value():
    from perseus_ext.policies.carbon import ExternalSignal, HTTPCarbonSignal
    from perseus_ext.policies.factories import build_policy
    from perseus_ext.policies.power_budget import PowerBudgetPolicy

    config = make_config(policy={"type": "power_budget", "budget": {"url": "http://127.0.0.1:1/budget"}})
    policy = build_policy(config.policy)
    assert isinstance(policy, PowerBudgetPolicy) and isinstance(policy.budget.signal, HTTPCarbonSignal)
    plane = _FakePlane()
    coordinator = JobCoordinator.create(config, plane, None, policy)
    assert isinstance(policy.budget.signal, ExternalSignal)  # this rank's poller is gone
    assert policy.budget.signal.intensity(0.0) is None  # nothing broadcast yet
    assert coordinator.on_iteration_end() is False
    assert plane.sent == [[0.0, 0.0, 0.0, 0.0, 0.0]]  # rank 1 contributes no reading of its own
    assert policy.budget.per_gpu_w() == 250.0
