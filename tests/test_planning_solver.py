"""The frontier solver: exactness on small pipelines, the paper's intrinsic savings, invariants."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import brute_force_min_energy, exact_min_energy, exact_solve
from perseus_ext.planning.profile import OperatingPoints, Profile, load_profile, pareto_indices
from perseus_ext.planning.schedule import ScheduleKind, ScheduleSummary, interleaved, one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

# The per-computation solver on its own: no clock-change budget (tests/test_clock_budget.py has it).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

PROFILES = Path(__file__).resolve().parents[1] / "examples" / "profiles"
A100 = PROFILES / "gpt3-175b-a100_sxm.csv"
P_BLOCK_A100 = 83.64


@pytest.fixture(scope="module")
def raw_a100() -> Profile:
    return load_profile(A100)


def sub_profile(raw: Profile, stages: int, clocks: tuple[int, ...]) -> Profile:
    """The first `stages` stages of a published profile, measured at `clocks` only."""
    rows = [r for r in raw.rows() if r["stage"] < stages and r["frequency"] in clocks]
    return Profile.from_rows(rows, source=f"{A100.name}[{stages} stages, {clocks}]")


def test_exact_milp_agrees_with_brute_force(raw_a100: Profile) -> None:
    profile = sub_profile(raw_a100, 2, (1410, 1200, 1050))
    model = CostModel(one_f_one_b(2, 3), profile, P_BLOCK_A100)
    t_min = model.replay(model.fastest_choice())[0]
    for factor in (1.0, 1.04, 1.1, 1.25):
        energy, choice = exact_min_energy(model, t_min * factor)
        assert energy == pytest.approx(brute_force_min_energy(model, t_min * factor), rel=1e-9)
        assert model.replay(choice)[0] <= t_min * factor + 1e-6
    assert exact_min_energy(model, t_min * 0.99) is None


SMALL_CASES = [
    (2, 3, (1410, 1200, 1050)),
    (2, 4, (1410, 1275, 1140, 1005)),
    (3, 3, (1410, 1200, 1050)),
    (3, 4, (1410, 1290, 1170, 1050)),
    (3, 4, (1410, 1350, 1215, 1080)),
    (2, 3, (1410, 1380, 1350, 1320)),
    (2, 3, (1410, 1365, 1020, 975)),
    (3, 4, (1410, 1080, 960)),
]


@pytest.mark.parametrize("stages, microbatches, clocks", SMALL_CASES)
def test_within_0_3_percent_of_optimal_at_every_deadline(
    raw_a100: Profile, stages: int, microbatches: int, clocks: tuple[int, ...]
) -> None:
    profile = sub_profile(raw_a100, stages, clocks)
    schedule = one_f_one_b(stages, microbatches)
    model = CostModel(schedule, profile, P_BLOCK_A100)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    t_min, t_end = frontier.plans[0].time, frontier.plans[-1].time
    worst = 0.0
    for deadline in np.linspace(t_min, t_end * 1.02, 30):
        optimum, choice = exact_min_energy(model, deadline)
        # The MILP meets the deadline up to HiGHS' feasibility tolerance (~1e-7 s).
        ours = frontier.plan_for_deadline(max(deadline, model.replay(choice)[0]))
        worst = max(worst, ours.energy / optimum - 1)
    assert worst <= 0.003, f"{100 * worst:.3f}% above the exact optimum"


def test_exact_solve_prints_nothing(raw_a100: Profile, capfd) -> None:
    """HiGHS's MIP solver wrote lines such as `HighsMipSolverData::transformNewIntegerFeasible
    Solution tmpSolver.run();` on the terminal (file descriptor 1, under scipy's `milp`); the
    yardstick must run silently, bounded by a time limit, with its bound."""
    model = CostModel(one_f_one_b(3, 4), sub_profile(raw_a100, 3, tuple(range(1410, 800, -45))), P_BLOCK_A100)
    t_min = float(model.replay(model.fastest_choice())[0])
    for factor in (1.0, 1.05):
        result = exact_solve(model, t_min * factor, rel_gap=1e-6, time_limit_s=5)
        assert result.lower_bound <= result.energy * (1 + 1e-9)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_highs_option_it_does_not_take_is_an_error() -> None:
    """highspy's `setOptionValue` reports an unknown name or a bad value only in the status it
    returns: every option the solver sets goes through `set_option`, which raises instead, so a
    later highspy that renamed one (`threads` keeps HiGHS's scheduler on the walk's threads)
    fails loudly rather than solving differently."""
    from perseus_ext.planning.relaxation import quiet_highs, set_option

    highs = quiet_highs()
    set_option(highs, "threads", 1)
    assert highs.getOptionValue("threads")[1] == 1
    with pytest.raises(SolverError, match="no_such_option"):
        set_option(highs, "no_such_option", 1)
    with pytest.raises(SolverError, match="presolve='sideways'"):
        set_option(highs, "presolve", "sideways")


def test_clocks_useful_only_with_slack_reach_the_all_clock_optimum(raw_a100: Profile) -> None:
    """Below each computation's least-energy clock, a slower clock costs a little more energy
    but less than the blocking energy it replaces where the computation has slack. The exact
    optimum over every profiled clock uses them; a planner filtering clocks on time and energy
    alone cannot reach it (here by more than the solver's whole gap), the solver must."""
    profile = sub_profile(raw_a100, 3, (1410, 1200, 1020, 960, 900, 870))
    schedule = one_f_one_b(3, 4)
    model = CostModel(schedule, profile, P_BLOCK_A100)
    energy_only = Profile({
        key: OperatingPoints(op.frequencies[keep], op.times[keep], op.energies[keep])
        for key, op in profile.points.items()
        for keep in [np.array(pareto_indices(op.times, op.energies))]
    })
    restricted = CostModel(schedule, energy_only, P_BLOCK_A100)
    assert restricted.num_options.sum() < model.num_options.sum()
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    worst, loss = 0.0, 0.0
    for deadline in np.linspace(frontier.fastest.time, frontier.min_energy.time * 1.02, 12):
        optimum, choice = exact_min_energy(model, deadline)
        loss = max(loss, exact_min_energy(restricted, deadline)[0] / optimum - 1)
        ours = frontier.plan_for_deadline(max(deadline, model.replay(choice)[0]))
        worst = max(worst, ours.energy / optimum - 1)
    assert worst <= 0.003, f"{100 * worst:.3f}% above the all-clock optimum"
    assert loss > worst + 0.002, f"energy-filtered clocks lose only {100 * loss:.3f}%"


def test_gap_targeted_polish_closes_on_the_all_clock_optimum(raw_a100: Profile) -> None:
    """The LP anchors bound every deadline's energy from below; where the best plan is far above
    that bound, the solver polishes plans at evenly spaced deadlines and carries them to the
    deadlines between. Here (32 computations x 13 clocks, too large for the full polish) it
    must at least halve the worst gap to the exact optimum over every profiled clock, and the
    bound must hold against that optimum at every deadline (it comes from the LP on the useful
    clocks only)."""
    from perseus_ext.planning.relaxation import AnchorWalk
    from perseus_ext.planning.solver import planning_model

    profile = sub_profile(raw_a100, 4, tuple(range(1410, 869, -45)))
    schedule = one_f_one_b(4, 4)
    model = CostModel(schedule, profile, P_BLOCK_A100)  # every profiled clock
    without = solve_frontier(schedule, profile, P_BLOCK_A100, SolverOptions(max_clock_changes_per_s=0, gap_polish_budget=0))
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    assert frontier.fastest.time == without.fastest.time == model.replay(model.fastest_choice())[0]

    planned = planning_model(schedule, profile, P_BLOCK_A100)
    t_min = float(planned.dag.makespan(planned.times[:, 0]))
    t_slowest = float(planned.dag.makespan(planned.times[np.arange(planned.num_nodes), planned.num_options - 1]))
    walk = AnchorWalk(planned, 64, t_min, t_slowest, lambda t_max: (t_max - t_min) / 500)
    walk.wait()
    walk.close()
    deadlines = np.linspace(t_min, frontier.min_energy.time, 10)
    bounds = walk.lower_bound(deadlines)
    worst, worst_without = 0.0, 0.0
    for deadline, bound in zip(deadlines, bounds):
        optimum, choice = exact_min_energy(model, deadline)
        assert bound <= optimum * (1 + 1e-9), f"bound {bound:.3f} J above the optimum {optimum:.3f} J"
        at = max(deadline, model.replay(choice)[0])  # the MILP meets it up to HiGHS' tolerance
        worst = max(worst, frontier.plan_for_deadline(at).energy / optimum - 1)
        worst_without = max(worst_without, without.plan_for_deadline(at).energy / optimum - 1)
    assert worst <= 0.001, f"{100 * worst:.3f}% above the all-clock optimum"
    assert worst < worst_without / 2, f"{100 * worst:.3f}% with the polish, {100 * worst_without:.3f}% without"


@pytest.fixture(scope="module", params=[12, 24, 48, 96])
def gpt3_frontier(request):
    profile = load_profile(A100)
    schedule = one_f_one_b(8, request.param)
    return request.param, CostModel(schedule, profile, P_BLOCK_A100), solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)


PAPER_INTRINSIC_SAVING = {12: 0.152, 24: 0.142, 48: 0.136, 96: 0.133}


def test_gpt3_fastest_plan_is_free_and_saves_what_the_paper_reports(gpt3_frontier) -> None:
    microbatches, model, frontier = gpt3_frontier
    all_max = model.replay(model.fastest_choice())
    assert frontier.fastest.time <= all_max[0] + 1e-9
    assert frontier.baseline.energy == pytest.approx(all_max[1])
    assert frontier.intrinsic_saving() >= PAPER_INTRINSIC_SAVING[microbatches]


def test_gpt3_frontier_invariants(gpt3_frontier) -> None:
    _, model, frontier = gpt3_frontier
    times = np.array([p.time for p in frontier.plans])
    energies = np.array([p.energy for p in frontier.plans])
    # A true Pareto frontier: slower plans are strictly cheaper, none is dominated.
    assert np.all(np.diff(times) > 0)
    assert np.all(np.diff(energies) < 0)
    # Gaps wider than the 1 ms grid only where the frontier is flat (< 0.5 % of energy).
    wide = np.flatnonzero(np.diff(times) > 1e-3)
    assert np.all(energies[wide] - energies[wide + 1] < 5e-3 * energies[wide])
    assert frontier.min_energy.energy < frontier.fastest.energy
    # Reported figures are exact replays of the discrete clocks.
    for plan in frontier.plans[:: max(1, len(frontier.plans) // 25)]:
        time, energy = model.replay(model.choice_of(plan))
        assert plan.time == pytest.approx(time, abs=1e-12)
        assert plan.energy == pytest.approx(energy, rel=1e-12)
    # The straggler lookup meets the deadline and never picks a dominated plan.
    for deadline in np.linspace(times[0], times[-1] * 1.1, 17):
        plan = frontier.plan_for_deadline(deadline)
        assert plan.time <= deadline + 1e-12
        assert plan.energy == min(p.energy for p in frontier.plans if p.time <= deadline + 1e-12)


def test_interleaved_frontier_meets_its_schedule(raw_a100: Profile) -> None:
    profile = sub_profile(raw_a100, 4, tuple(range(1410, 1000, -60)))
    schedule = interleaved(4, 8, 2)
    frontier = solve_frontier(schedule, profile, P_BLOCK_A100, UNBUDGETED)
    assert frontier.schedule == ScheduleSummary(ScheduleKind.INTERLEAVED, stages=4, microbatches=8, virtual_stages=2)
    assert frontier.fastest.frequencies.shape == (4, 32)
    assert frontier.intrinsic_saving() > 0.05


def test_bad_solver_options_are_rejected(raw_a100: Profile) -> None:
    with pytest.raises(SolverError, match="resolution"):
        solve_frontier(one_f_one_b(2, 2), sub_profile(raw_a100, 2, (1410, 1200)), 83.64, SolverOptions(max_clock_changes_per_s=0, resolution=0))


def test_profile_whose_slower_clocks_save_no_time(recwarn) -> None:
    """Degenerate but valid input: every clock takes the same time (only energy differs)."""
    rows = [
        {"stage": s, "instruction": i, "frequency": f, "time": t, "energy": e}
        for s in range(2)
        for i, t in (("forward", 0.05), ("backward", 0.1))
        for f, e in ((1410, 30.0), (1200, 25.0))
    ]
    profile = Profile.from_rows(rows)
    frontier = solve_frontier(one_f_one_b(2, 3), profile, P_BLOCK_A100, UNBUDGETED)
    assert len(frontier.plans) == 1
    # 1410 MHz is dominated (same time, more energy): every computation runs at 1200 MHz.
    assert set(frontier.fastest.frequencies.ravel().tolist()) == {1200}
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _reclaim_node_by_node(model: CostModel, choice: np.ndarray, deadlines: np.ndarray, cap, backward_first):
    """The slack reclaim's definition, one node at a time (the solver batches DAG levels)."""
    dag, choice = model.dag, choice.astype(np.int64).copy()
    rows = np.arange(model.num_nodes)[:, None]

    def refit(node: int, window: np.ndarray) -> None:
        options = model.times[node, : model.num_options[node]]
        best = np.maximum(np.searchsorted(options, window + 1e-9, side="right") - 1, 0)
        if cap is not None:
            best = np.minimum(best, cap[node])
        choice[node] = np.maximum(best, choice[node])

    def forward() -> None:
        latest = dag.latest_finish_times(model.times[rows, choice], deadlines)
        finish = np.zeros((model.num_nodes + 1, choice.shape[1]))
        for node in range(model.num_nodes):
            start = finish[dag.predecessors(node)].max(axis=0, initial=0.0)
            refit(node, latest[node] - start)
            finish[node] = start + model.times[node, choice[node]]

    def backward() -> None:
        durations = model.times[rows, choice]
        earliest = dag.finish_times(durations) - durations
        latest_start = np.empty((model.num_nodes + 1, choice.shape[1]))
        latest_start[-1] = deadlines
        for node in range(model.num_nodes - 1, -1, -1):
            succs = dag.successors(node)
            end = latest_start[succs].min(axis=0) if len(succs) else latest_start[-1]
            refit(node, end - earliest[node])
            latest_start[node] = end - model.times[node, choice[node]]

    for run_pass in (backward, forward) if backward_first else (forward, backward):
        run_pass()
    return choice


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 6), interleaved(4, 8, 2)], ids=["1f1b", "interleaved"])
def test_level_batched_passes_match_their_node_by_node_definition(raw_a100: Profile, schedule) -> None:
    from perseus_ext.planning.passes import reclaim_slack, round_to_options

    model = CostModel(schedule, sub_profile(raw_a100, 4, tuple(range(1410, 900, -45))), P_BLOCK_A100)
    rng = np.random.default_rng(7)
    plans = 40
    fastest = model.times[:, :1]
    slowest = model.times[np.arange(model.num_nodes), model.num_options - 1][:, None]
    relaxed = fastest + rng.random((model.num_nodes, plans)) * (slowest - fastest)
    rounded = round_to_options(model, relaxed)
    rows = np.arange(model.num_nodes)[:, None]
    t_down, t_up = model.times[rows, rounded["down"]], model.times[rows, rounded["up"]]
    # down: the slowest clock no slower than the relaxed duration; up: the next slower one.
    assert np.all(t_down <= relaxed + 1e-9)
    assert np.all((t_up >= relaxed - 1e-9) | (rounded["up"] == (model.num_options - 1)[:, None]))
    assert np.all((rounded["nearest"] == rounded["down"]) | (rounded["nearest"] == rounded["up"]))

    deadlines = model.dag.makespan(t_down) + rng.random(plans) * 0.05
    cap = np.minimum(rounded["down"] + rng.integers(0, 3, rounded["down"].shape), (model.num_options - 1)[:, None])
    for backward_first in (False, True):
        for bound in (None, cap):
            got = reclaim_slack(model, rounded["down"], deadlines, bound, backward_first)
            want = _reclaim_node_by_node(model, rounded["down"], deadlines, bound, backward_first)
            np.testing.assert_array_equal(got, want)
            assert np.all(got >= rounded["down"])
            assert np.all(model.dag.makespan(model.times[rows, got]) <= deadlines + 1e-9)


def test_lp_walk_failure_reaches_the_caller_and_stops_the_walk(raw_a100: Profile, monkeypatch) -> None:
    """The LP walk runs on two background threads: an error in either surfaces in the solving
    thread and stops both ends of the walk."""
    import threading

    from perseus_ext.planning import relaxation

    real = relaxation.ConvexRelaxation.durations
    calls = []

    def failing(self, deadline: float):
        calls.append(deadline)
        if len(calls) == 5:
            raise SolverError(f"LP relaxation at T={deadline:.6f}s ended with Infeasible")
        return real(self, deadline)

    monkeypatch.setattr(relaxation.ConvexRelaxation, "durations", failing)
    with pytest.raises(SolverError, match="ended with Infeasible"):
        solve_frontier(one_f_one_b(4, 8), sub_profile(raw_a100, 4, (1410, 1200, 1000)), P_BLOCK_A100, UNBUDGETED)
    assert 5 <= len(calls) <= 8  # the other end finishes the anchor it was solving (of ~100)
    assert not [t for t in threading.enumerate() if t.name == "frontier-lp-walk"]


def test_the_frontier_does_not_depend_on_thread_timing(raw_a100: Profile, monkeypatch) -> None:
    """The LP walk's two ends run concurrently; how far each got when must not change a single
    plan. Here one end or the other is slowed down."""
    import time

    from perseus_ext.planning import relaxation

    profile = sub_profile(raw_a100, 4, (1410, 1290, 1170, 1050, 930))

    def solve() -> list[tuple[float, float, bytes]]:
        frontier = solve_frontier(one_f_one_b(4, 8), profile, P_BLOCK_A100, UNBUDGETED)
        return [(p.time, p.energy, p.frequencies.tobytes()) for p in frontier.plans]

    reference = solve()
    middle = (reference[0][0] + reference[-1][0]) / 2
    real = relaxation.ConvexRelaxation.durations
    for slow_low_end in (True, False):
        def durations(self, deadline: float, slow_low_end: bool = slow_low_end) -> np.ndarray:
            if (deadline < middle) == slow_low_end:
                time.sleep(0.002)
            return real(self, deadline)

        monkeypatch.setattr(relaxation.ConvexRelaxation, "durations", durations)
        assert solve() == reference


# A caller's own HiGHS, in the solving thread, with a thread count other than the walk's one.
HIGHS_BESIDE_THE_WALK = """
import numpy as np, highspy
from perseus_ext.data import shipped_profile
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

def callers_lp(threads):
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", threads)
    x = h.addVariable(lb=0, ub=10)
    h.addConstr(x >= 1)
    h.minimize(x)
    return h.modelStatusToString(h.getModelStatus())

before = callers_lp(2)
frontier = solve_frontier(one_f_one_b(8, 8), load_profile(shipped_profile("gpt3-175b-a100_sxm")), 83.64, UNBUDGETED)
print("RESULT", before, callers_lp(2), len(frontier.plans) > 10)  # highspy.Highs() prints a banner
"""


def test_the_walk_s_one_thread_highs_leaves_a_caller_s_highs_alone() -> None:
    """HiGHS's task scheduler cannot change its size once a thread has started it; the walk
    asks for one HiGHS thread, on its own threads only, so a caller's HiGHS with another size
    works before and after a solve (in a fresh interpreter: no other test's HiGHS first)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HIGHS_BESIDE_THE_WALK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT Optimal Optimal True"], done.stdout


def test_lp_anchors_lie_on_grid_deadlines(raw_a100: Profile, monkeypatch) -> None:
    """Each LP anchor but the last (where the grid ends) is one of the solver's grid deadlines,
    so that deadline rounds the LP's own optimum, not a blend of two anchors' optima."""
    from perseus_ext.planning import first_pass, relaxation

    seen, kept = [], []
    real, real_wait = first_pass.interpolate, relaxation.AnchorWalk.wait

    def spy(anchors: np.ndarray, durations: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
        seen.append(deadlines.copy())
        return real(anchors, durations, deadlines)

    def wait(walk):
        kept.append(real_wait(walk))
        return kept[-1]

    monkeypatch.setattr(first_pass, "interpolate", spy)
    monkeypatch.setattr(relaxation.AnchorWalk, "wait", wait)
    solve_frontier(one_f_one_b(4, 8), sub_profile(raw_a100, 4, (1410, 1290, 1170, 1050, 930)), P_BLOCK_A100, UNBUDGETED)
    anchors = kept[0]
    grid = np.sort(np.concatenate(seen))
    assert len(anchors) > 20 and np.all(np.diff(anchors) > 0)
    assert np.isin(anchors[:-1], grid).all()  # exactly equal, not merely close
    assert anchors[-1] <= grid[-1]


def test_passes_split_over_two_threads_give_the_same_candidates_and_raise_the_helper_s_error() -> None:
    """`in_two` runs the second half of a big pass on a helper thread: the candidates must be
    the single-thread ones, column for column, and an error there must reach the solver."""
    import threading

    from perseus_ext.planning import pool
    from perseus_ext.planning.first_pass import first_pass_block

    profile = load_profile(A100)
    model = CostModel(one_f_one_b(8, 12), profile, P_BLOCK_A100)
    columns = pool.SPLIT_COLUMNS + 3
    rng = np.random.default_rng(7)
    relaxed = model.times[:, :1] + rng.random((model.num_nodes, columns)) * 0.02
    deadlines = np.full(columns, float(model.replay(model.fastest_choice())[0]) * 1.1)
    threads = set()

    def work(lo: int, hi: int):
        threads.add(threading.get_ident())
        return first_pass_block(model, relaxed[:, lo:hi], deadlines[lo:hi], lo)

    split = pool.in_two(work, columns)
    assert len(threads) == 2
    for got, want in zip(split, first_pass_block(model, relaxed, deadlines, 0), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)

    def failing(lo: int, hi: int):
        if lo:
            raise SolverError("second half failed")
        return work(lo, hi)

    with pytest.raises(SolverError, match="second half failed"):
        pool.in_two(failing, columns)


def test_the_walk_s_threads_round_blocks_as_their_anchors_arrive(raw_a100: Profile, monkeypatch) -> None:
    """Each end of the LP walk rounds grid blocks once it has solved its anchors (`FirstPass`):
    blocks are taken by both ends, and the candidates are exactly those of rounding the whole
    grid at once after the walk; an error in a block reaches the solving thread."""
    import threading
    import time

    from perseus_ext.planning import first_pass, relaxation

    model = CostModel(one_f_one_b(4, 8), sub_profile(raw_a100, 4, (1410, 1290, 1170, 1050, 930)), P_BLOCK_A100)
    t_min = float(model.dag.makespan(model.times[:, 0]))
    t_slowest = float(model.dag.makespan(model.times[np.arange(model.num_nodes), model.num_options - 1]))
    step = (t_slowest - t_min) / 900

    def grid_of(walk):
        return t_min + step * np.arange(int(np.ceil((walk.deadlines[-1] - t_min) / step)) + 1)

    monkeypatch.setattr(first_pass, "BLOCK_COLUMNS", 40)
    taken_by: dict[int, set[int]] = {}
    real_block = first_pass.first_pass_block

    def block(model, relaxed, deadlines, first):
        taken_by.setdefault(threading.get_ident(), set()).add(first)
        time.sleep(0.03)  # longer than the two ends' finishing times differ: both take blocks
        return real_block(model, relaxed, deadlines, first)

    monkeypatch.setattr(first_pass, "first_pass_block", block)
    rounding = first_pass.FirstPass(model, grid_of, lambda deadlines: 1 + 4 * deadlines)
    walk = relaxation.AnchorWalk(model, 64, t_min, t_slowest, lambda t: step, then=rounding.take_blocks)
    anchors = walk.wait()
    durations = walk.anchor_columns(0, len(anchors) - 1)
    walk.close()
    grid = rounding.grid
    assert len(taken_by) == 2 and sum(map(len, taken_by.values())) == -(-len(grid) // 40)
    # Column 0 is the caller's; then per block of 40 deadlines its three kinds, in grid order.
    buffer, times, energies = rounding.hand_over()
    assert len(times) == len(energies) == 1 + 3 * len(grid) and buffer.shape[1] == 1 + 4 * len(grid)
    whole = real_block(model, relaxation.interpolate(anchors, durations, grid), grid, 0)
    for kind, (choices, want_times, want_energies) in enumerate(whole):
        columns = np.concatenate([
            1 + 3 * first + kind * min(40, len(grid) - first) + np.arange(min(40, len(grid) - first))
            for first in range(0, len(grid), 40)
        ])
        np.testing.assert_array_equal(buffer[:, columns], choices)
        np.testing.assert_array_equal(times[columns], want_times)
        np.testing.assert_array_equal(energies[columns], want_energies)
        if kind == 0:  # each deadline's own reclaimed plan
            np.testing.assert_array_equal(rounding.reclaimed_columns(), columns)

    def failing(model, relaxed, deadlines, first):
        if first >= 200:
            raise SolverError("block failed")
        return real_block(model, relaxed, deadlines, first)

    monkeypatch.setattr(first_pass, "first_pass_block", failing)
    rounding = first_pass.FirstPass(model, grid_of, lambda deadlines: 1 + 4 * deadlines)
    walk = relaxation.AnchorWalk(model, 64, t_min, t_slowest, lambda t: step, then=rounding.take_blocks)
    with pytest.raises(SolverError, match="block failed"):
        walk.wait()
    walk.close()
    assert not [t for t in threading.enumerate() if t.name == "frontier-lp-walk"]


def test_one_search_per_dag_level_matches_a_search_per_table() -> None:
    """`_MixedLevel` replaces a search per option table with one search in their union and a
    lookup: it must pick each row's slowest fitting option exactly, windows on and a hair
    around option times included, and levels with the same tables must share it."""
    from perseus_ext.planning import passes

    rng = np.random.default_rng(3)
    tables = [np.sort(rng.choice(np.arange(1, 60) * 1e-3, size=k, replace=False)) for k in (3, 7, 12, 20)]
    rows = [tables[i] for i in (0, 2, 2, 3, 1, 0)]
    level = passes._MixedLevel(rows)
    on_options = np.concatenate(tables)
    window = np.concatenate([
        rng.random((len(rows), 200)) * 0.07 - 0.005,
        np.tile(np.r_[on_options, on_options + 1e-9, on_options + 2e-9, on_options - 1e-12], (len(rows), 1)),
    ], axis=1)
    best = level.slowest_fitting(window)
    for r, options in enumerate(rows):
        want = passes._slowest_fitting(options, window[r])
        np.testing.assert_array_equal(best[r], want)
        np.testing.assert_array_equal(level.times(best)[r], options[want])

    model = CostModel(one_f_one_b(8, 24), load_profile(A100), P_BLOCK_A100)
    by_level = passes._OptionTables(model).by_level
    mixed = [tables for tables in by_level if isinstance(tables, passes._MixedLevel)]
    assert len(mixed) > len({id(tables) for tables in mixed})  # shared, not one per level


def test_option_tables_are_built_once_when_both_pass_threads_ask(monkeypatch) -> None:
    """The split passes ask for a model's option tables from two threads at once (8 x 96 built
    them twice): one must build, the other wait for it and get the same object."""
    import threading
    import time

    from perseus_ext.planning import passes

    model = CostModel(one_f_one_b(8, 12), load_profile(A100), P_BLOCK_A100)
    builds = []
    real_init = passes._OptionTables.__init__

    def slow_init(self, model: CostModel) -> None:
        builds.append(1)
        time.sleep(0.2)  # widen the window in which the other thread asks
        real_init(self, model)

    monkeypatch.setattr(passes._OptionTables, "__init__", slow_init)
    got = []
    threads = [threading.Thread(target=lambda: got.append(passes._OptionTables.of(model))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and got[0] is got[1]
