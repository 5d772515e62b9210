"""The clock-change budget: plans that change each GPU's clock at most so often.

The oracles share no code with the planner: plans are replayed here from the schedule's stage
orders, the pipeline's data dependencies and the profile's rows (`independent_replay`), clock
changes are located and counted here over iterations laid back to back, and optimality is the
exact MILP (HiGHS) with the same clock groups as rows of its formulation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_profiles import P_BLOCK_A100, profile_path, sub_profile

from perseus_ext.config.perseus import PerseusConfig
from perseus_ext.errors import ConfigError
from perseus_ext.planning.clock_budget import choose_cut
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import exact_solve
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.grouped import solve_grouped
from perseus_ext.planning.groups import ClockGroups
from perseus_ext.planning.options import ClockBudget
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import Kind, PipelineSchedule, one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.planning.thinning import with_fewer_switches

CLOCKS = tuple(range(1410, 1000, -30))


@pytest.fixture(scope="module")
def raw() -> Profile:
    return load_profile(profile_path("gpt3-175b-a100_sxm"))


def independent_replay(schedule: PipelineSchedule, profile: Profile, plan: Plan) -> tuple[float, float, list[list[tuple[float, float, int]]]]:
    """(iteration time, energy, per stage [(start, finish, clock)] in its order) of a 1F1B plan:
    each stage runs its order one computation at a time; forward m on stage s waits for forward
    m on stage s - 1, backward m on stage s for backward m on stage s + 1."""
    stages = schedule.num_stages
    finish: dict[tuple[int, int, str], float] = {}
    runs: list[list[tuple[float, float, int]]] = [[] for _ in range(stages)]
    position = [0] * stages
    total = sum(len(order) for order in schedule.orders)
    done = 0
    while done < total:
        progressed = False
        for s in range(stages):
            order = schedule.orders[s]
            while position[s] < len(order):
                c = order[position[s]]
                kind = "forward" if c.kind is Kind.FORWARD else "backward"
                dependency = (s - 1, c.microbatch, "forward") if kind == "forward" else (s + 1, c.microbatch, "backward")
                needs_peer = (kind == "forward" and s > 0) or (kind == "backward" and s < stages - 1)
                if needs_peer and dependency not in finish:
                    break
                clock = plan.for_stage(s)[position[s]]
                points = profile[s, kind]
                seconds = float(points.times[list(points.frequencies).index(clock)])
                start = max(runs[s][-1][1] if runs[s] else 0.0, finish[dependency] if needs_peer else 0.0)
                runs[s].append((start, start + seconds, clock))
                finish[(s, c.microbatch, kind)] = start + seconds
                position[s] += 1
                done += 1
                progressed = True
        assert progressed, "the schedule deadlocks"
    time = max(run[-1][1] for run in runs)
    energy, busy = 0.0, 0.0
    for s, order in enumerate(schedule.orders):
        for c, (start, end, clock) in zip(order, runs[s]):
            points = profile[s, "forward" if c.kind is Kind.FORWARD else "backward"]
            energy += float(points.energies[list(points.frequencies).index(clock)])
            busy += end - start
    return time, energy + P_BLOCK_A100 * (stages * time - busy), runs


def budget_kept(runs: list[tuple[float, float, int]], period: float, budget: ClockBudget, iterations: int = 4) -> tuple[bool, float, int]:
    """(kept, shortest hold, most changes in a half-open second) of one stage's runs repeated
    `iterations` times back to back: a change falls at the end of the computation before one
    with another clock (the next iteration's first clock: at its first computation's start)."""
    changes = []
    for k in range(iterations):
        offset = k * period
        for j, (start, _, clock) in enumerate(runs):
            before = runs[j - 1][2] if j else (runs[-1][2] if k else clock)
            if clock != before:
                changes.append(offset + (runs[j - 1][1] if j else start))
    changes.sort()
    holds = np.diff(changes) if len(changes) > 1 else np.array([math.inf])
    shortest = float(holds.min()) if holds.size else math.inf
    most = max((sum(1 for t in changes if c <= t < c + 1.0 - 1e-9) for c in changes), default=0)
    limit_ok = budget.max_changes_per_s <= 0 or most <= budget.max_changes_per_s
    return limit_ok and shortest >= budget.min_hold_s - 1e-9, shortest, most


def test_budgeted_plans_replayed_independently_keep_the_budget_and_their_figures(raw: Profile) -> None:
    schedule, profile = one_f_one_b(4, 6), sub_profile(raw, 4, CLOCKS)
    options = SolverOptions(max_clock_changes_per_s=4, min_clock_hold_s=0.2)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, options, wait_aware=True)
    unbudgeted = solve_frontier(schedule, profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=0))
    assert max(p.clock.changes_per_s for p in unbudgeted.plans) > 4  # the budget has work to do
    assert len(frontier.plans) > 10 and frontier.extension_start is not None
    assert frontier.fastest.time == pytest.approx(unbudgeted.fastest.time, abs=1e-12)
    assert frontier.fastest.energy < frontier.baseline.energy
    for plan in frontier.plans:
        time, energy, runs = independent_replay(schedule, profile, plan)
        assert plan.time == pytest.approx(time, rel=1e-9)
        assert plan.energy == pytest.approx(energy, rel=1e-9)
        rates, holds = [], []
        for stage_runs in runs:
            kept, shortest, most = budget_kept(stage_runs, time, options.clock_budget)
            assert kept, (plan.time, shortest, most)
            rates.append(most)
            holds.append(shortest)
        assert plan.clock.changes_per_s == max(rates)
        assert plan.clock.shortest_hold_s == pytest.approx(min(holds), rel=1e-9)
    times = [p.time for p in frontier.ordinary_plans]
    energies = [p.energy for p in frontier.ordinary_plans]
    assert np.all(np.diff(times) > 0) and np.all(np.diff(energies) < 0)


def test_a_tighter_budget_costs_more_and_none_costs_least(raw: Profile) -> None:
    schedule, profile = one_f_one_b(3, 4), sub_profile(raw, 3, CLOCKS)
    deadline = 1.05 * solve_frontier(schedule, profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=0)).fastest.time
    energies = [solve_frontier(schedule, profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=rate))
                .plan_for_deadline(deadline).energy for rate in (0, 8, 3, 1)]
    assert energies == sorted(energies) and energies[-1] > energies[0]


@pytest.mark.parametrize("cut", ["runs", "chosen"])
def test_grouped_solver_within_a_tenth_of_a_percent_of_the_grouped_milp(raw: Profile, cut: str) -> None:
    """The grouped solver against the exact MILP with the same groups, over every clock."""
    schedule, profile = one_f_one_b(3, 4), sub_profile(raw, 3, tuple(range(1410, 1000, -45)))
    model = CostModel(schedule, profile, P_BLOCK_A100)
    if cut == "runs":
        groups = ClockGroups.runs(schedule, 3)
    else:
        unbudgeted = solve_frontier(schedule, profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=0))
        reference = unbudgeted.plan_for_deadline(unbudgeted.fastest.time * 1.05)
        groups = choose_cut(model, 0.25, model.choice_of(reference), unbudgeted.fastest.time * 1.05)
        assert 3 < len(groups.groups) < model.num_nodes
    _, times, energies = solve_grouped(model, groups, 256)  # what solve_within_budget gives a pipeline this small
    t_min = times.min()
    worst = 0.0
    for deadline in np.linspace(t_min, t_min * 1.2, 9):
        oracle = exact_solve(model, float(deadline), groups=groups)
        ours = energies[times <= deadline + 1e-9].min()
        worst = max(worst, ours / oracle.energy - 1)
    assert worst <= 1e-3


def test_fewer_switches_never_breaks_the_budget(raw: Profile) -> None:
    schedule, profile = one_f_one_b(3, 4), sub_profile(raw, 3, CLOCKS)
    options = SolverOptions(max_clock_changes_per_s=3)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, options, switch_latency_s=0.01, wait_aware=True)
    thinned = with_fewer_switches(frontier, schedule, profile, P_BLOCK_A100, 0.01, switch_cost_j=2.0)
    budget = options.clock_budget
    assert thinned.plans and all(budget.allows(p.clock.changes_per_s, p.clock.shortest_hold_s) for p in thinned.plans)


def test_figures_travel_in_the_frontier_file_and_to_the_ranks(raw: Profile, tmp_path) -> None:
    schedule, profile = one_f_one_b(2, 4), sub_profile(raw, 2, CLOCKS)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100)
    frontier.save(tmp_path / "f.json")
    loaded = Frontier.load(tmp_path / "f.json")
    assert [p.clock for p in loaded.plans] == [p.clock for p in frontier.plans]
    table = frontier.stage_table(1)
    assert table.clock_figures(0).changes_per_s == frontier.plans[0].clock.changes_per_s


# --------------------------------------------------------------------------- the options at the door
BUDGET_KEYS = ("max_clock_changes_per_s", "min_clock_hold_s")
HIGHEST = {"max_clock_changes_per_s": 1000.0, "min_clock_hold_s": 60.0}


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(BUDGET_KEYS),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6),
                       st.text(max_size=8), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_budget_options_are_checked_at_the_door(key: str, value) -> None:
    good = (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and 0 <= value <= HIGHEST[key])
    if good:
        config = PerseusConfig.from_dict({"solver": {key: value}})
        assert getattr(config.solver, key) == value
        return
    with pytest.raises(ConfigError, match=rf"perseus\.solver\.{key}"):
        PerseusConfig.from_dict({"solver": {key: value}})


def test_zero_means_no_budget_and_the_default_is_five_a_second() -> None:
    assert SolverOptions().clock_budget == ClockBudget(5.0, 0.0)
    assert SolverOptions().clock_budget.hold_s == pytest.approx(0.2)
    assert not SolverOptions(max_clock_changes_per_s=0).clock_budget.active
    assert SolverOptions(max_clock_changes_per_s=0, min_clock_hold_s=0.5).clock_budget.hold_s == 0.5
