"""Power swing: the metrics against a hand-computed pipeline, swing-capped plans replayed
independently (a replay written here from the 1F1B rules, not the planner's DAG), and the
`--power-swing-cap` flag and `perseus.solver.power_swing_cap` key at the door."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.planning.actions import Kind
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.power_swing import plan_power_traces, swing_figures
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.planning.swing_cap import capped_frontier
from tests.planning_profiles import P_BLOCK_A100, profile_path

BLOCK_W = 50.0
# stage, kind: (clock MHz, seconds, watts) -- powers and times chosen to add up by hand
POINTS = {
    (0, "forward"): [(1000, 0.100, 300.0), (800, 0.125, 200.0), (600, 0.160, 150.0)],
    (0, "backward"): [(1000, 0.200, 300.0), (800, 0.250, 200.0), (600, 0.320, 150.0)],
    (1, "forward"): [(1000, 0.100, 350.0), (800, 0.125, 240.0), (600, 0.160, 170.0)],
    (1, "backward"): [(1000, 0.200, 350.0), (800, 0.250, 240.0), (600, 0.320, 170.0)],
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("swing") / "two.csv"
    rows = ["stage,instruction,frequency,time,energy"]
    for (stage, kind), points in POINTS.items():
        rows += [f"{stage},{kind},{mhz},{t},{t * w}" for mhz, t, w in points]
    path.write_text("\n".join(rows) + "\n")
    return load_profile(path)


def test_swing_figures_of_a_hand_computed_two_stage_pipeline(profile):
    # 2 stages x 1 microbatch at max clocks: F0 [0, .1), F1 [.1, .2), B1 [.2, .4), B0 [.4, .6);
    # the other GPU waits at 50 W. Pipeline power: 350 W for .1 s, 400 W for .3 s, 350 W for .2 s.
    schedule = build_schedule("1f1b", 2, 1)
    model = CostModel(schedule, profile, BLOCK_W)
    trace = plan_power_traces(model, model.fastest_choice())[0]
    assert trace.period_s == pytest.approx(0.6)
    figures = trace.figures()
    assert figures.mean_w == pytest.approx((350 * 0.1 + 400 * 0.3 + 350 * 0.2) / 0.6)
    assert figures.peak_to_trough_w == pytest.approx(50.0)
    assert figures.peak_to_trough_fraction == pytest.approx(50.0 / figures.mean_w)
    # A 50 W step through a 50 ms moving average ramps at 50 / 0.05 = 1000 W/s.
    assert figures.max_ramp_w_per_s == pytest.approx(1000.0)
    # A square wave (400 W half the period, 350 W the other) of period 0.6 s: variance
    # 25^2 = 625 W^2, of which the odd harmonic k holds 8 / (pi k)^2; the band ends at 20 Hz,
    # the 12th harmonic, so it holds the odd ones up to the 11th.
    in_band = sum(8 / (np.pi * k) ** 2 for k in range(1, 12, 2))
    assert figures.band_energy_w2 == pytest.approx(625 * in_band, rel=2e-3)
    assert figures.band_energy_fraction == pytest.approx(in_band, rel=2e-3)


def test_swing_figures_of_a_sine_are_its_amplitude():
    dt = 1e-3
    t = np.arange(1000) * dt  # one period of 1 Hz
    power = 1000 + 100 * np.sin(2 * np.pi * t)
    figures = swing_figures(power, dt)
    assert figures.peak_to_trough_w == pytest.approx(200.0, rel=1e-4)
    assert figures.band_energy_w2 == pytest.approx(100**2 / 2)  # a sine's variance: A^2 / 2
    assert figures.band_energy_fraction == pytest.approx(1.0)
    # The slope of a 50 ms average of A sin(wt) peaks at A w sinc: ~ 2 pi 100 sin(pi 0.05)/(pi 0.05).
    assert figures.max_ramp_w_per_s == pytest.approx(2 * np.pi * 100 * np.sin(np.pi * 0.05) / (np.pi * 0.05), rel=1e-3)
    # 50 Hz is outside the band.
    assert swing_figures(1000 + 100 * np.sin(2 * np.pi * 50 * t), dt).band_energy_fraction == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("bad", [np.array([]), np.array([1.0, np.nan]), np.array([-1.0, 2.0])])
def test_bad_traces_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="power_w"):
        swing_figures(bad, 1e-3)


def _replay(schedule, profile, plan, filler, points=None, block_w=BLOCK_W):
    """Independent replay of a 1F1B plan: starts from the 1F1B rules (a stage's order; F(s, m)
    after F(s-1, m); B(s, m) after B(s+1, m)), then the pipeline's exact power by event sweep
    and its 1 ms averages, filler added. `points`: {(stage, kind): {MHz: (s, W)}}, by default
    the hand-made `POINTS`."""
    if points is None:
        points = {key: {mhz: (t, w) for mhz, t, w in pts} for key, pts in POINTS.items()}
    finish, start, power = {}, {}, {}
    pending = [(s, k) for s in range(schedule.num_stages) for k in range(len(schedule.orders[s]))]
    while pending:
        for s, k in list(pending):
            c = schedule.orders[s][k]
            deps = [schedule.orders[s][k - 1]] if k else []
            if c.kind is Kind.FORWARD and s > 0:
                deps += [x for x in schedule.orders[s - 1] if x.kind is Kind.FORWARD and x.microbatch == c.microbatch]
            if c.kind is Kind.BACKWARD and s < schedule.num_stages - 1:
                deps += [x for x in schedule.orders[s + 1] if x.kind is Kind.BACKWARD and x.microbatch == c.microbatch]
            if all(d in finish for d in deps):
                t, w = points[(s, c.kind.value)][int(plan.for_stage(s)[k])]
                start[c] = max([finish[d] for d in deps], default=0.0)
                finish[c], power[c] = start[c] + t, w
                pending.remove((s, k))
    period = max(finish.values())
    energy = sum((finish[c] - start[c]) * (power[c] - block_w) for c in finish) + block_w * schedule.num_stages * period
    edges = np.linspace(0, period, round(period / 1e-3) + 1)
    binned = np.full(len(edges) - 1, block_w * schedule.num_stages)
    for c in finish:
        overlap = np.clip(np.minimum(edges[1:], finish[c]) - np.maximum(edges[:-1], start[c]), 0, None)
        binned += overlap / np.diff(edges) * (power[c] - block_w)
    for a, b, w in zip(filler.breakpoints_s[:-1], filler.breakpoints_s[1:], filler.power_w):
        binned += np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None) / np.diff(edges) * w
    return period, energy + filler.energy_j, binned.max() - binned.min(), binned


@pytest.mark.parametrize("cap", [0.6, 0.3])
def test_capped_plans_replayed_independently_meet_cap_time_and_energy(profile, cap):
    schedule = build_schedule("1f1b", 2, 3)
    options = SolverOptions(max_clock_changes_per_s=0.0)
    frontier = solve_frontier(schedule, profile, BLOCK_W, options)
    _, all_max_energy, all_max_swing, _ = _replay(schedule, profile, frontier.baseline, _no_filler(frontier))
    assert all_max_energy == pytest.approx(frontier.baseline.energy)
    capped = capped_frontier(frontier, schedule, profile, cap)
    assert capped.reference.peak_to_trough_w == pytest.approx(all_max_swing, rel=1e-9)
    assert len(capped.plans) >= 1
    assert any(p.filler.energy_j > 0 for p in capped.plans)  # the cap binds: dummy work is needed
    times = [p.plan.time for p in capped.plans]
    assert times == sorted(times)
    for item in capped.plans:
        period, energy, swing, binned = _replay(schedule, profile, item.plan, item.filler)
        assert item.plan.time == pytest.approx(period, abs=1e-9)
        assert item.plan.energy == pytest.approx(energy, rel=1e-9)
        assert item.swing.peak_to_trough_w == pytest.approx(swing, abs=1e-6)
        assert swing <= cap * all_max_swing + 1e-6
        assert np.all(item.filler.power_w >= 0)
    # The cap costs energy only where it binds: the cheapest capped plan is no cheaper than the
    # uncapped frontier's cheapest plan.
    assert min(p.plan.energy for p in capped.plans) >= frontier.min_energy.energy - 1e-6


class _AllMaxClocks:
    """A plan of every computation at its stage's highest profiled clock (`Plan.for_stage`)."""

    def __init__(self, schedule, points):
        self._clocks = [np.array([max(points[(s, c.kind.value)]) for c in order])
                        for s, order in enumerate(schedule.orders)]

    def for_stage(self, stage):
        return self._clocks[stage]


def _no_filler(frontier):
    from perseus_ext.planning.swing_cap import Filler

    return Filler(np.array([0.0, frontier.baseline.time]), np.array([0.0]))


def _frontier_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perseus_ext", "frontier", "--profile", "gpt3-175b-a100_sxm",
                           "--microbatches", "2", *args], capture_output=True, text=True, timeout=120)


@settings(max_examples=8, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0 < x <= 1).map(repr),
                 st.sampled_from(["abc", "", "0", "1.5", "-0.25", "nan"])))
def test_bad_power_swing_cap_flag_is_one_error_line_and_exit_2(text):
    from perseus_ext.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["frontier", "--profile", "x.csv", "--microbatches", "2", "--power-swing-cap", text])
    assert exit_info.value.code == 2


def test_bad_flag_prints_usage_and_one_error_line():
    result = _frontier_cli("--power-swing-cap", "1.5")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("usage:")
    assert [line for line in lines if "error:" in line] == [lines[-1]]
    assert "--power-swing-cap" in lines[-1] and "(0, 1]" in lines[-1]


@given(st.floats(min_value=0.0, max_value=1.0))
@settings(max_examples=20, deadline=None)
def test_config_key_takes_fractions(value):
    from perseus_ext.config.perseus import PerseusConfig

    assert PerseusConfig(solver={"power_swing_cap": value}).solver.power_swing_cap == value


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True])
def test_config_key_refuses_other_values_naming_it(value):
    from perseus_ext.config.perseus import PerseusConfig

    with pytest.raises(Exception, match="power_swing_cap"):
        PerseusConfig(solver={"power_swing_cap": value})


def test_the_solver_option_caps_every_plan(profile):
    """`perseus.solver.power_swing_cap` reaches the solver: every plan it returns meets the cap
    in the independent replay, dummy work counted."""
    schedule = build_schedule("1f1b", 2, 3)
    options = SolverOptions(max_clock_changes_per_s=0.0, power_swing_cap=0.3)
    frontier = solve_frontier(schedule, profile, BLOCK_W, options)
    uncapped = solve_frontier(schedule, profile, BLOCK_W, SolverOptions(max_clock_changes_per_s=0.0))
    _, _, all_max_swing, _ = _replay(schedule, profile, uncapped.baseline, _no_filler(uncapped))
    capped = capped_frontier(uncapped, schedule, profile, 0.3)
    assert [(p.time, p.energy) for p in frontier.plans] == [(p.plan.time, p.plan.energy) for p in capped.plans]
    for item in capped.plans:
        _, energy, swing, _ = _replay(schedule, profile, item.plan, item.filler)
        assert swing <= 0.3 * all_max_swing + 1e-6
        assert item.plan.energy == pytest.approx(energy, rel=1e-9)


@pytest.mark.parametrize("cap, met", [(0.05, False), (0.6, True)])
def test_clocks_only_plans_carry_their_true_swing(profile, cap, met):
    """`filler_max_w` at the blocking power (GPUs that cannot run dummy work): no filler is
    drawn; a cap the clocks cannot meet comes back as the plan of least swing, flagged, not
    as an error; every plan's swing and flag agree with the independent replay."""
    schedule = build_schedule("1f1b", 2, 3)
    frontier = solve_frontier(schedule, profile, BLOCK_W, SolverOptions(max_clock_changes_per_s=0.0))
    _, _, all_max_swing, _ = _replay(schedule, profile, frontier.baseline, _no_filler(frontier))
    capped = capped_frontier(frontier, schedule, profile, cap, filler_max_w=BLOCK_W)
    assert capped.meets_cap is met
    assert len(capped.plans) >= 1 if met else len(capped.plans) == 1
    swings = []
    for item in capped.plans:
        assert item.filler.energy_j == 0.0
        period, energy, swing, _ = _replay(schedule, profile, item.plan, item.filler)
        assert item.plan.time == pytest.approx(period, abs=1e-9)
        assert item.plan.energy == pytest.approx(energy, rel=1e-9)
        assert item.swing.peak_to_trough_w == pytest.approx(swing, abs=1e-6)
        assert item.meets_cap == bool(swing <= cap * all_max_swing + 1e-6)
        swings.append(swing)
    if not met:  # the least swing of any plan the uncapped frontier holds, or less
        uncapped_swings = [_replay(schedule, profile, p, _no_filler(frontier))[2] for p in frontier.plans]
        assert swings[0] <= min(uncapped_swings) + 1e-6


@pytest.fixture(scope="module")
def gpt3_8x4():
    """GPT-3 on A100, 8 stages x 4 microbatches, the default solver options (with their clock
    budget): its uncapped frontier, and the profile's points for the independent replay."""
    real = load_profile(profile_path("gpt3-175b-a100_sxm"))
    schedule = build_schedule("1f1b", real.num_stages, 4)
    block_w = P_BLOCK_A100
    options = SolverOptions()
    assert options.clock_budget.active
    frontier = solve_frontier(schedule, real, block_w, options)
    points = {key: {int(f): (float(t), float(e / t)) for f, t, e in zip(op.frequencies, op.times, op.energies)}
              for key, op in real.points.items()}
    return real, schedule, block_w, options, frontier, points


@pytest.mark.parametrize("cap, most_extra", [(0.5, 0.002), (0.25, 0.035)])
def test_capped_plan_within_1_05_t_costs_at_most_the_targets(gpt3_8x4, cap, most_extra):
    """The cheapest capped plan within 1.05 x the all-max-clock time costs at most +0.2 % (cap
    0.5) / +3.5 % (cap 0.25) over the uncapped cheapest plan at that deadline, same solver
    options, and meets its cap, its time, its energy and the clock budget in the replay."""
    real, schedule, block_w, options, frontier, points = gpt3_8x4
    # The cap's reference is every computation at its highest measured clock (the solver's own
    # baseline may leave out a top clock that is no faster), replayed here as well.
    all_max = _AllMaxClocks(schedule, points)
    _, _, all_max_swing, _ = _replay(schedule, real, all_max, _no_filler(frontier), points, block_w)
    deadline = 1.05 * frontier.baseline.time
    uncapped = frontier.plan_for_deadline(deadline)
    capped = capped_frontier(frontier, schedule, real, cap, deadlines_s=(deadline,), clock_budget=options.clock_budget)
    assert capped.meets_cap
    plan = capped.frontier.plan_for_deadline(deadline)
    item = capped.plans[capped.frontier.plans.index(plan)]
    period, energy, swing, _ = _replay(schedule, real, plan, item.filler, points, block_w)
    assert period == pytest.approx(plan.time, abs=1e-9) and period <= deadline + 1e-9
    assert energy == pytest.approx(plan.energy, rel=1e-9)
    assert swing <= cap * all_max_swing + 1e-6
    assert options.clock_budget.allows(plan.clock.changes_per_s, plan.clock.shortest_hold_s)
    assert plan.energy <= (1 + most_extra) * uncapped.energy
