"""Zeus and Chase inside the large-scale emulator (GPT-3 slice, TP 8 x PP 8, DP 8, x10 scaling):
the emulator calls the same `select` as the runtime, so this is what the runtime would deploy."""

from __future__ import annotations

from pathlib import Path

import pytest

from perseus_ext.emulator import PERSEUS, Emulator, JobLayout, StragglerScenario
from perseus_ext.planning.profile import load_profile
from perseus_ext.policies import (
    CallbackCarbonSignal,
    CarbonCost,
    ChasePolicy,
    OperatingPointPolicy,
    StragglerPolicy,
    ZeusPolicy,
)

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = JobLayout(tensor_parallel=8, pipeline_parallel=8, global_batch=64, microbatches=8)
A100_BLOCKING_W = 83.64
A100_MAX_POWER_W = 400.0


@pytest.fixture(scope="module")
def profile():
    return load_profile(ROOT / "examples" / "profiles" / "gpt3-175b-a100_sxm.csv")


@pytest.fixture(scope="module")
def emulator(profile):
    return Emulator(profile, LAYOUT, A100_BLOCKING_W, time_scale=10)  # frontier solved once


@pytest.fixture(scope="module")
def frontier(emulator):
    return emulator.frontier


def emulate(emulator: Emulator, policy: OperatingPointPolicy, factor: float):
    emulator.policy = policy
    return emulator.run(StragglerScenario.fixed(factor))


def test_eta_zero_matches_perseus_in_the_emulator(emulator, frontier) -> None:
    """eta 0 prices time only: both policies deploy the fastest plan with no straggler and, held
    to T' = 1.2 T, the plan of least energy plus wait (worked out from the frontier's figures)."""
    stages = frontier.schedule.stages
    held = 1.2 * frontier.fastest.time
    done = [p for p in frontier.plans if p.time <= held]
    expected = {1.0: frontier.plans[0],
                1.2: min(done, key=lambda p: (p.energy + stages * frontier.blocking_power * (held - p.time), p.time))}
    for factor, plan in expected.items():
        perseus = emulate(emulator, StragglerPolicy(), factor)
        zeus = emulate(emulator, ZeusPolicy(0.0, A100_MAX_POWER_W, gpus_per_stage=8), factor)
        assert zeus.outcomes[PERSEUS].deployments == perseus.outcomes[PERSEUS].deployments
        assert perseus.outcomes[PERSEUS].deployments[0].others is plan
        assert zeus.total_saving == pytest.approx(perseus.total_saving)


def test_more_eta_trades_time_for_energy(emulator, frontier) -> None:
    etas = (0.0, 0.3, 0.6, 0.9, 1.0)
    results = [emulate(emulator, ZeusPolicy(eta, A100_MAX_POWER_W, gpus_per_stage=8), 1.0) for eta in etas]
    iterations = [result.outcomes[PERSEUS].iteration for result in results]
    assert len(iterations) == len(etas)
    for previous, iteration in zip(iterations, iterations[1:]):
        assert iteration.time >= previous.time - 1e-9
        assert iteration.total <= previous.total + 1e-6
    # eta 1 prices energy only: the least-energy plan of the ordinary frontier (no straggler, no wait)
    cheapest = min(frontier.plans[: frontier.extension_start], key=lambda p: p.energy)
    assert results[-1].outcomes[PERSEUS].deployments[0].others is cheapest
    assert iterations[-1].time > frontier.fastest.time


def test_carbon_high_and_low_move_the_deployed_plan_both_ways(emulator) -> None:
    intensity = {"value": 500.0}
    clock = {"now": 0.0}
    policy = ChasePolicy(
        CarbonCost(
            0.6,
            A100_MAX_POWER_W,
            CallbackCarbonSignal(lambda now: intensity["value"]),
            max_carbon=500.0,
            period_s=60.0,
            clock=lambda: clock["now"],
        ),
        gpus_per_stage=8,
    )
    deployed = []
    for value in (500.0, 20.0, 500.0):
        intensity["value"] = value
        clock["now"] += 61.0
        deployed.append(emulate(emulator, policy, 1.0).outcomes[PERSEUS].deployments[0].others)
    dirty, clean, dirty_again = deployed
    assert clean.time < dirty.time and clean.energy > dirty.energy
    assert dirty_again == dirty


def test_power_budget_beats_one_power_limit_and_one_clock_at_equal_power(emulator) -> None:
    """Budgets 60-100 % of the all-max-clock power: perseus-ext's budget policy fits every
    budget and is at least as fast as both baselines; in the middle it is clearly faster."""
    from perseus_ext.emulator.power_budget import (
        BUDGET_POLICY,
        GLOBAL_CLOCK,
        POWER_LIMIT,
        PowerBudgetComparison,
        budget_table,
    )

    comparison = PowerBudgetComparison(emulator)
    rows = comparison.sweep()
    assert [row.fraction for row in rows][0] == 0.6 and rows[-1].fraction == 1.0
    batch = LAYOUT.global_batch
    for row in rows:
        ours = row.outcomes[BUDGET_POLICY]
        assert ours.fits and ours.power_w <= row.budget_w * (1 + 1e-9)
        for baseline in (POWER_LIMIT, GLOBAL_CLOCK):
            assert ours.throughput(batch) >= row.outcomes[baseline].throughput(batch) * (1 - 1e-12)
    top = rows[-1].outcomes
    assert top[BUDGET_POLICY].time_s == pytest.approx(comparison.max_clock[0])
    assert top[POWER_LIMIT].time_s == pytest.approx(comparison.max_clock[0])
    middle = {row.fraction: row for row in rows}[0.8].outcomes
    assert middle[BUDGET_POLICY].throughput(batch) > 1.03 * middle[POWER_LIMIT].throughput(batch)
    table = budget_table(comparison, rows)
    assert "global power limit" in table and len(table.splitlines()) == 2 + len(rows)
