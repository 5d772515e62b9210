"""Latency-aware plans: the replay formula by hand and by an independent scalar replay, the
merge and repair passes, and the frontier at 0 latency."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.errors import ProfileError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, planning_model, solve_frontier
from perseus_ext.planning.switching import count_switches, merge_switches, repair_latency
from perseus_ext.planning.thinning import with_fewer_switches
from perseus_ext.planning.wait_aware import plan_ending_at, waiting_energy
from planning_profiles import P_BLOCK_A100, profile_path, sub_profile

# The per-computation solver on its own: no clock-change budget (tests/test_clock_budget.py has it).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)


def hand_profile() -> Profile:
    rows = []
    for stage in range(2):
        for kind, fast, slow in (("forward", (1.0, 10.0), (2.0, 6.0)), ("backward", (2.0, 20.0), (3.0, 15.0))):
            rows.append({"stage": stage, "instruction": kind, "frequency": 1000, "time": fast[0], "energy": fast[1]})
            rows.append({"stage": stage, "instruction": kind, "frequency": 500, "time": slow[0], "energy": slow[1]})
    return Profile.from_rows(rows, source="hand")


def choice_for(model: CostModel, clocks: dict[str, int]) -> np.ndarray:
    """Option indices from {'F@s0': option, ...} keyed by the computations' names."""
    return np.array([clocks[str(c)] for c in model.dag.computations])


def test_latency_formula_by_hand() -> None:
    # F@s0 -> F@s1 -> B@s1 -> B@s0 (one microbatch), L = 0.5 s, P_block = 5 W.
    model = CostModel(one_f_one_b(2, 1), hand_profile(), 5.0, switch_latency_s=0.5)
    choice = choice_for(model, {"F0@s0": 0, "F0@s1": 1, "B0@s1": 0, "B0@s0": 1})
    trace = model.latency_trace(choice)
    by_name = {str(c): i for i, c in enumerate(model.dag.computations)}
    # F0@s1 is requested at t = 0 and starts at 1 >= L: no penalty. B0@s1 starts when F0@s1
    # ends: 0.5 s of it at 500 MHz (1/6 of its work), then 5/6 at 1000 MHz. B0@s0 starts long
    # after F0@s0 ended: no penalty.
    assert trace.durations[by_name["F0@s1"]] == pytest.approx(2.0)
    assert trace.durations[by_name["B0@s1"]] == pytest.approx(0.5 + 5 / 6 * 2)
    assert trace.node_energies[by_name["B0@s1"]] == pytest.approx(0.5 * 15 / 3 + 5 / 6 * 20)
    assert trace.durations[by_name["B0@s0"]] == pytest.approx(3.0)
    time, energy = model.replay(choice)
    assert time == pytest.approx(1 + 2 + 0.5 + 5 / 3 + 3)
    assert energy == pytest.approx(10 + 6 + 2.5 + 50 / 3 + 15 + 5 * (2 * time - (4 + 2 + 0.5 + 5 / 3)))
    # The first computation of stage 0 starts at t = 0 with the fastest clock in force.
    slow_start = choice_for(model, {"F0@s0": 1, "F0@s1": 0, "B0@s1": 0, "B0@s0": 0})
    trace = model.latency_trace(slow_start)
    assert trace.durations[by_name["F0@s0"]] == pytest.approx(0.5 + 0.5 * 2.0)
    assert trace.node_energies[by_name["F0@s0"]] == pytest.approx(0.5 * 10 + 0.5 * 6)


def scalar_replay(model: CostModel, choice: np.ndarray, latency: float) -> tuple[float, float]:
    """The latency model written out computation by computation, from the schedule alone."""
    schedule = model.schedule
    clock = {c: model.frequencies[model.dag.index[c], choice[model.dag.index[c]]] for o in schedule.orders for c in o}

    def option_at(c, mhz):  # the option of c nearest to `mhz`
        i = model.dag.index[c]
        freqs = model.frequencies[i, : model.num_options[i]]
        return int(np.argmin(np.abs(freqs - mhz)))

    finish: dict = {}
    busy = energy = 0.0
    pending = {s: 0 for s in range(schedule.num_stages)}
    while len(finish) < model.num_nodes:
        for s, order in enumerate(schedule.orders):
            while pending[s] < len(order):
                c = order[pending[s]]
                deps = [model.dag.computations[p] for p in model.dag.predecessors(model.dag.index[c])]
                if any(d not in finish for d in deps):
                    break
                start = max([finish[d] for d in deps], default=0.0)
                i = model.dag.index[c]
                if pending[s] == 0:
                    prev_end, prev_mhz = 0.0, model.frequencies[i, 0]
                else:
                    prev_end, prev_mhz = finish[order[pending[s] - 1]], clock[order[pending[s] - 1]]
                own = choice[i]
                old = option_at(c, prev_mhz)
                t_own, e_own = model.times[i, own], model.energies[i, own]
                t_old, e_old = model.times[i, old], model.energies[i, old]
                tau = min(max(prev_end + latency - start, 0.0), t_old) if old != own else 0.0
                duration = tau + (1 - tau / t_old) * t_own
                energy += tau / t_old * e_old + (1 - tau / t_old) * e_own
                busy += duration
                finish[c] = start + duration
                pending[s] += 1
    makespan = max(finish.values())
    return makespan, energy + model.blocking_power * (schedule.num_stages * makespan - busy)


@pytest.fixture(scope="module")
def raw_a100() -> Profile:
    return load_profile(profile_path("gpt3-175b-a100_sxm"))


def test_every_plan_reports_its_exact_latency_aware_replay(raw_a100: Profile) -> None:
    profile = sub_profile(raw_a100, 3, (1410, 1290, 1170, 1050, 930))
    schedule = one_f_one_b(3, 5)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, switch_latency_s=0.01, options=UNBUDGETED)
    model = planning_model(schedule, profile, P_BLOCK_A100, switch_latency_s=0.01)
    assert frontier.baseline.time == pytest.approx(model.replay(model.fastest_choice(), 0.0)[0])
    for plan in frontier.plans:
        time, energy = scalar_replay(model, model.choice_of(plan), 0.01)
        assert plan.time == pytest.approx(time, rel=1e-12)
        assert plan.energy == pytest.approx(energy, rel=1e-12)


def test_zero_latency_is_the_latency_free_model(raw_a100: Profile) -> None:
    profile = sub_profile(raw_a100, 3, (1410, 1290, 1170, 1050, 930))
    model = CostModel(one_f_one_b(3, 5), profile, P_BLOCK_A100)
    rng = np.random.default_rng(1)
    choices = rng.integers(0, 5, size=(model.num_nodes, 40)) % model.num_options[:, None]
    plain = model.replay(choices)
    limit = model.replay(choices, switch_latency_s=1e-300)  # the latency path, no latency
    np.testing.assert_allclose(limit[0], plain[0], rtol=1e-14)
    np.testing.assert_allclose(limit[1], plain[1], rtol=1e-13)
    a = solve_frontier(one_f_one_b(3, 5), profile, P_BLOCK_A100, UNBUDGETED)
    b = solve_frontier(one_f_one_b(3, 5), profile, P_BLOCK_A100, switch_latency_s=0.0, options=UNBUDGETED)
    assert [(p.time, p.energy) for p in a.plans] == [(p.time, p.energy) for p in b.plans]
    assert all(np.array_equal(p.frequencies, q.frequencies) for p, q in zip(a.plans, b.plans))


def test_merge_never_makes_a_plan_worse_and_repair_meets_deadlines(raw_a100: Profile) -> None:
    profile = sub_profile(raw_a100, 4, tuple(range(1410, 850, -60)))
    model = CostModel(one_f_one_b(4, 8), profile, P_BLOCK_A100, switch_latency_s=0.02)
    rng = np.random.default_rng(2)
    choices = rng.integers(0, 10, size=(model.num_nodes, 64)) % model.num_options[:, None]
    times, energies = model.replay(choices)
    merged = merge_switches(model, choices, times)
    new_times, new_energies = model.replay(merged)
    assert np.all(new_times <= times + 1e-9)
    assert np.all(new_energies <= energies + 1e-9)
    assert np.sum(new_energies < energies - 1e-6) >= 32  # it does find savings
    free_times = model.replay(choices, switch_latency_s=0.0)[0]
    repaired = repair_latency(model, choices, free_times)
    assert np.mean(model.replay(repaired)[0] <= free_times + 1e-9) >= 0.9


def clock_changes(plan) -> int:
    f = plan.frequencies
    return int((np.diff(f, axis=1) != 0).sum() + (f[:, 0] != f.max()).sum())


def test_latency_cuts_clock_changes_on_gpt3() -> None:
    profile = load_profile(profile_path("gpt3-175b-a100_sxm"))
    schedule = one_f_one_b(8, 12)
    instant = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    slow = solve_frontier(schedule, profile, P_BLOCK_A100, switch_latency_s=0.02, options=UNBUDGETED)
    deadlines = instant.baseline.time * np.array([1.0, 1.02, 1.05, 1.1, 1.2])
    changes = [sum(clock_changes(f.plan_for_deadline(d)) for d in deadlines) for f in (instant, slow)]
    assert changes[1] < changes[0]
    assert slow.intrinsic_saving() > 0.1  # latency costs some of the free saving, not all


def test_switch_count_by_hand() -> None:
    model = CostModel(one_f_one_b(2, 2), hand_profile(), 0.0)
    assert count_switches(model, np.zeros(model.num_nodes, dtype=int)) == 0
    one_slow = np.zeros((model.num_nodes, 2), dtype=int)
    one_slow[model.dag.stage_positions[0][1], 0] = 1  # the middle of stage 0's four computations
    one_slow[model.dag.stage_positions[1][-1], 1] = 1  # the last of stage 1's
    assert count_switches(model, one_slow).tolist() == [2, 1]


def test_a_switch_cost_trades_a_few_joules_for_fewer_changes(raw_a100: Profile) -> None:
    """Merging with a switch cost never makes a plan later, never adds cost (energy plus the
    cost per change), removes changes, and gives up at most the cost per change it removes."""
    profile = sub_profile(raw_a100, 4, tuple(range(1410, 850, -60)))
    model = CostModel(one_f_one_b(4, 8), profile, P_BLOCK_A100, switch_latency_s=0.005)
    rng = np.random.default_rng(5)
    choices = rng.integers(0, 10, size=(model.num_nodes, 32)) % model.num_options[:, None]
    times, energies = model.replay(choices)
    cost_j = 2.0
    merged = merge_switches(model, choices, times, switch_cost_j=cost_j)
    new_times, new_energies = model.replay(merged)
    before, after = count_switches(model, choices), count_switches(model, merged)
    assert np.all(new_times <= times + 1e-9)
    assert np.all(new_energies + cost_j * after <= energies + cost_j * before + 1e-9)
    assert after.sum() < before.sum()
    assert np.all(new_energies - energies <= cost_j * (before - after) + 1e-9)


def test_fewer_switches_keeps_the_frontier_honest_and_nearly_as_cheap(raw_a100: Profile) -> None:
    """The thinned frontier: every plan is its exact replay, the fastest plan is as fast, and
    for every deadline the iteration is held to, the chosen plan costs at most the switch cost
    per change more than before while making fewer changes in all."""
    profile = sub_profile(raw_a100, 4, tuple(range(1410, 600, -90)))
    schedule = one_f_one_b(4, 8)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, switch_latency_s=0.005, wait_aware=True, options=UNBUDGETED)
    cost_j = 5.0  # a quarter of a computation's energy: changes between neighbouring clocks go
    thinned = with_fewer_switches(frontier, schedule, profile, P_BLOCK_A100, 0.005, cost_j)
    model = planning_model(schedule, profile, P_BLOCK_A100, 0.005, wait_aware=True)
    for plan in thinned.plans:
        assert (plan.time, plan.energy) == pytest.approx(model.replay(model.choice_of(plan)))
    assert thinned.fastest.time <= frontier.fastest.time + 1e-9
    ordinary = thinned.plans[:thinned.extension_start]
    assert ordinary[-1].energy == min(plan.energy for plan in thinned.plans)  # T* is the ordinary end
    assert all(a.time < b.time and a.energy > b.energy for a, b in zip(ordinary, ordinary[1:]))
    assert thinned.extension_start is not None and 0 < thinned.extension_start < len(thinned.plans)
    changes = {"before": 0, "after": 0}
    for factor in (1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5):
        deadline = frontier.fastest.time * factor
        old, new = plan_ending_at(frontier, deadline), plan_ending_at(thinned, deadline)
        old_n, new_n = (int(count_switches(model, model.choice_of(p))) for p in (old, new))
        changes["before"] += old_n
        changes["after"] += new_n
        assert waiting_energy(thinned, new, deadline) <= (
            waiting_energy(frontier, old, deadline) + cost_j * max(old_n, 1) + 1e-6)
    assert changes["after"] < changes["before"]


def test_bad_switch_latency_is_rejected() -> None:
    with pytest.raises(ProfileError, match="switch_latency_s"):
        CostModel(one_f_one_b(2, 1), hand_profile(), 5.0, switch_latency_s=-0.1)
