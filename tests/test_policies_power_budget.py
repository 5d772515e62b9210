"""The power-budget policy: the fastest frontier plan whose average power (waits included) fits
a budget that may change while the job runs. Hand-computable on a 4-plan frontier of one
1-GPU stage: A 10 s 1000 J (100 W), B 11 s 900 J (81.8 W), C 12 s 850 J (70.8 W),
D 14 s 824 J (58.9 W); blocking power 20 W."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from perseus_ext.errors import ConfigError
from perseus_ext.policies.carbon import CSVCarbonTrace, CallbackCarbonSignal, ExternalSignal
from perseus_ext.config.policy import BudgetScope
from perseus_ext.policies.power_budget import (
    POWER_BUDGET,
    PowerBudget,
    PowerBudgetPolicy,
    average_power_w,
)
from test_policies import POINTS, A, B, C, D, index, make_frontier

FRONTIER = make_frontier(POINTS, blocking_power=20.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pick(budget_w: float, straggler_time: float | None = None) -> int:
    policy = PowerBudgetPolicy(PowerBudget(budget_w))
    return index(FRONTIER, policy.select(FRONTIER, straggler_time))


@pytest.mark.parametrize("budget_w, expected", [(100.0, A), (90.0, B), (75.0, C), (60.0, D)])
def test_fastest_plan_within_the_budget(budget_w: float, expected: int) -> None:
    assert pick(budget_w) == expected


def test_waits_count_at_blocking_power_and_never_race_ahead() -> None:
    # Straggler at 11.5 s: B waits 0.5 s at 20 W, (900 + 10) / 11.5 = 79.1 W, and now fits 80 W.
    assert average_power_w(FRONTIER, FRONTIER.plans[B], 11.5) == pytest.approx(910 / 11.5)
    assert pick(80.0) == C and pick(80.0, straggler_time=11.5) == B
    # Straggler at 12 s: A, B and C all take 12 s; the lowest-power of them, even with room.
    assert pick(100.0, straggler_time=12.0) == C


def test_job_wide_budget_and_gpus_per_stage() -> None:
    assert PowerBudget(800.0, scope=BudgetScope.JOB, num_gpus=10).per_gpu_w() == 80.0
    two_gpu_stage = PowerBudgetPolicy(PowerBudget(45.0), gpus_per_stage=2)  # 90 W per stage
    assert index(FRONTIER, two_gpu_stage.select(FRONTIER, None)) == B


def test_a_budget_below_every_plan_runs_the_lowest_power_one(caplog: pytest.LogCaptureFixture) -> None:
    policy = PowerBudgetPolicy(PowerBudget(50.0))
    with caplog.at_level(logging.WARNING):
        assert index(FRONTIER, policy.select(FRONTIER, None)) == D
        policy.select(FRONTIER, None)
    assert policy.last is not None and not policy.last.fits
    assert caplog.text.count("is below the lowest-power plan") == 1  # said once


def test_the_plan_follows_a_budget_schedule_within_one_period(tmp_path: Path) -> None:
    path = tmp_path / "budget.csv"
    path.write_text("timestamp,budget_w\n0,100\n100,60\n")
    clock = FakeClock()
    signal = CSVCarbonTrace(path, align="clock", quantity=POWER_BUDGET)
    policy = PowerBudgetPolicy(PowerBudget(signal, period_s=60.0, clock=clock))
    assert policy.period_s == 60.0  # the runtime re-selects at least this often
    picks = []
    for now in (0.0, 61.0, 121.0):  # the runtime's re-selections, one period apart
        clock.now = now
        picks.append(index(FRONTIER, policy.select(FRONTIER, None)))
    assert picks == [A, A, D]  # the budget fell at 100 s; the plan followed by 121 s


def test_budget_sources_callback_and_fed() -> None:
    clock = FakeClock()
    watts = {"now": 90.0}
    callback = PowerBudget(
        CallbackCarbonSignal(lambda now: watts["now"], quantity=POWER_BUDGET), period_s=1.0, clock=clock
    )
    assert callback.per_gpu_w() == 90.0
    watts["now"] = 60.0
    clock.now = 1.0
    assert callback.per_gpu_w() == 60.0
    fed = ExternalSignal(POWER_BUDGET)
    policy = PowerBudgetPolicy(PowerBudget(fed, period_s=1.0, clock=clock))
    assert policy.select(FRONTIER, None) == FRONTIER.fastest  # no budget yet: no slowdown
    fed.feed(75.0)
    clock.now = 20.0
    assert index(FRONTIER, policy.select(FRONTIER, None)) == C


def test_bad_budgets_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="perseus.policy.budget.watts must be a positive number"):
        PowerBudget(0.0)
    path = tmp_path / "bad.csv"
    path.write_text("timestamp,carbon_intensity\n0,5\n")
    with pytest.raises(ConfigError, match="power budget column .budget_w/power_w/watts."):
        CSVCarbonTrace(path, quantity=POWER_BUDGET)
