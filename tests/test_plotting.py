"""Figures: frontier, pipeline timeline and savings plots render and reject bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perseus_ext.observability import plotting
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import build_schedule

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model():
    profile = load_profile(ROOT / "examples" / "profiles" / "gpt3-175b-a100_sxm.csv")
    return CostModel(build_schedule("1f1b", 8, 6), profile, 83.64)


@pytest.fixture(scope="module")
def frontier(model):
    """A small frontier of uniform-slowdown plans (the plotting code needs no solver)."""
    width = int(model.num_options.min())
    choices = np.stack([np.minimum(k, model.num_options - 1) for k in range(width)], axis=1)
    times, energies = model.replay(choices)
    plans = model.make_plans(choices, times, energies)
    order = np.argsort(times)
    kept, best = [], np.inf
    for j in order:  # Pareto filter by time, then energy
        if energies[j] < best:
            kept.append(plans[j])
            best = energies[j]
    baseline = model.to_plan(model.fastest_choice())
    return Frontier(model.schedule.summary(), model.blocking_power, tuple(kept), baseline)


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC


def test_frontier_png_and_svg(frontier, tmp_path):
    marks = {"deployed": frontier.plans[-1], "straggler": frontier.plan_for_deadline(frontier.fastest.time * 1.05)}
    plotting.plot_frontier(frontier, tmp_path / "f.png", marks=marks, title="test")
    assert _is_png(tmp_path / "f.png")
    plotting.plot_frontier(frontier, tmp_path / "sub" / "f.svg")
    assert (tmp_path / "sub" / "f.svg").read_text().lstrip().startswith("<?xml")


def test_timeline_panels_from_plans_and_choices(model, frontier, tmp_path):
    path = tmp_path / "t.png"
    plotting.plot_timeline(
        model,
        {"before": frontier.baseline, "after": model.min_energy_choice()},
        path,
        title="before/after",
        slowdowns=[frontier.fastest.time * 1.2] * 2,
    )
    assert _is_png(path)
    plotting.plot_timeline(model, frontier.fastest, tmp_path / "one.png")
    plotting.plot_timeline(model, [frontier.fastest, frontier.plans[-1]], tmp_path / "two.png")
    assert _is_png(tmp_path / "two.png")


def test_timeline_rejects_bad_input(model, frontier, tmp_path):
    with pytest.raises(plotting.PlottingError, match="one option index per computation"):
        plotting.plot_timeline(model, np.zeros(3, dtype=int), tmp_path / "x.png")
    with pytest.raises(plotting.PlottingError, match="2 slowdowns for 1 timeline panels"):
        plotting.plot_timeline(model, {"a": frontier.fastest}, tmp_path / "x.png", slowdowns=[1.0, 2.0])
    with pytest.raises(plotting.PlottingError, match="at least one plan"):
        plotting.plot_timeline(model, {}, tmp_path / "x.png")


def test_savings_plot_and_validation(tmp_path):
    plotting.plot_savings([1.0, 1.1, 1.2], {"a": [0.1, 0.15, 0.2], "b": [0.0, 0.05, 0.1]}, tmp_path / "s.png")
    assert _is_png(tmp_path / "s.png")
    with pytest.raises(plotting.PlottingError, match="series 'a' has 2 savings for 3"):
        plotting.plot_savings([1.0, 1.1, 1.2], {"a": [0.1, 0.2]}, tmp_path / "s.png")


def test_unsupported_suffix(frontier, tmp_path):
    with pytest.raises(plotting.PlottingError, match=r"\.png, \.svg, \.pdf"):
        plotting.plot_frontier(frontier, tmp_path / "f.jpg")


def test_missing_matplotlib_is_a_clear_error(frontier, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(plotting.PlottingError, match=r"pip install perseus-ext\[plot\]"):
        plotting.plot_frontier(frontier, tmp_path / "f.png")


def test_importing_plotting_and_emulator_does_not_import_matplotlib():
    code = (
        "import sys, perseus_ext.observability.plotting, perseus_ext.emulator, perseus_ext.commands.emulate; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_energy_units():
    assert plotting._energy_unit(5e5) == ("kJ", 1e3)
    assert plotting._energy_unit(7.2e7) == ("MJ", 1e6)
    assert plotting._energy_unit(12.0) == ("J", 1.0)


def test_run_timeline_legend_covers_no_data_and_profiling_does_not_squash_the_rest(tmp_path, monkeypatch):
    """The legend sat over the profiling spike, and the spike (6x slower iterations) set the
    scale, so the deployed runs' differences were a flat line."""
    drawn = {}
    monkeypatch.setattr(plotting, "_save", lambda figure, path: drawn.update(figure=figure))
    phases = ["warmup"] * 2 + ["profiling"] * 6 + ["solving"] * 2 + ["deployed"] * 30
    perseus_time = [0.5] * 2 + [0.5, 0.8, 1.4, 2.1, 2.9, 3.1] + [0.5] * 2 + [0.51] * 30
    baseline_time = [0.5] * 40
    perseus_energy = [700.0] * 2 + [650, 640, 800, 1100, 1500, 1700] + [700] * 2 + [600.0] * 30
    series = {"default clocks": {"time_s": baseline_time, "energy_j": [720.0] * 40},
              "perseus-ext": {"time_s": perseus_time, "energy_j": perseus_energy}}
    plotting.plot_run_timeline(series, phases, tmp_path / "run.png", straggler=(20, 30))
    figure = drawn["figure"]
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legend = figure.legends[0].get_window_extent(renderer)
    top, bottom = figure.axes
    for axis in (top, bottom):
        assert not legend.overlaps(axis.get_window_extent(renderer))
    assert top.get_ylim()[1] < 1.0 and bottom.get_ylim()[1] < 1000  # scaled to the non-profiling iterations
    assert top.get_ylim()[0] == 0 and bottom.get_ylim()[0] == 0  # from zero
    notes = [text.get_text() for axis in (top, bottom) for text in axis.texts]
    assert "profiling: up to 3.1 s (off scale)" in notes and "profiling: up to 1.7e+03 J (off scale)" in notes


def _captured(monkeypatch) -> dict:
    drawn: dict = {}
    monkeypatch.setattr(plotting, "_save", lambda figure, path: drawn.update(figure=figure))
    return drawn


def _rgb(color) -> np.ndarray:
    from matplotlib.colors import to_rgb

    return np.array(to_rgb(color))


def test_run_timeline_noise_stays_noise_and_lines_stand_out_from_the_bands(tmp_path, monkeypatch):
    """A DeepSpeed run's iterations of 0.200-0.205 s filled the whole axis, so noise looked like
    spikes; the baseline line was drawn in the deployed band's green."""
    drawn = _captured(monkeypatch)
    phases = ["warmup"] * 2 + ["profiling"] * 4 + ["solving"] + ["deployed"] * 33
    rng = np.random.default_rng(3)
    noisy = list(0.2 + 0.005 * rng.random(40))
    series = {"perseus-ext": {"time_s": noisy, "energy_j": list(300 + 5 * rng.random(40))},
              "baseline": {"time_s": list(0.2 + 0.005 * rng.random(40)), "energy_j": [330.0] * 40}}
    plotting.plot_run_timeline(series, phases, tmp_path / "run.png")
    top, bottom = drawn["figure"].axes
    low, high = top.get_ylim()
    assert low == 0 and (max(noisy) - min(noisy)) / (high - low) < 0.05  # 2.5 % noise spans < 5 % of the axis
    assert bottom.get_ylim()[0] == 0
    bands = [_rgb(color) for color in plotting.PHASE_COLORS.values()]
    lines = top.get_lines()
    assert len(lines) == 2
    for line in lines:
        assert min(np.abs(_rgb(line.get_color()) - band).sum() for band in bands) > 0.3, line.get_label()
    assert np.abs(_rgb(lines[0].get_color()) - _rgb(lines[1].get_color())).sum() > 0.3
    assert lines[0].get_linestyle() != lines[1].get_linestyle()


def test_frontier_axis_from_zero_and_legend_counts_are_the_frontiers(frontier, tmp_path, monkeypatch):
    """The legend said '80 plans' and '34 plans' where the console said 114."""
    drawn = _captured(monkeypatch)
    slower = [Plan(plan.time * 1.5 + 0.01 * k, plan.energy * 1.02, plan.frequencies)
              for k, plan in enumerate(frontier.plans[:3])]
    extended = Frontier(frontier.schedule, frontier.blocking_power, frontier.plans + tuple(slower),
                        frontier.baseline, extension_start=len(frontier.plans))
    plotting.plot_frontier(extended, tmp_path / "frontier.png")
    axis = drawn["figure"].axes[0]
    assert axis.get_ylim()[0] == 0
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    total = len(extended.plans)
    assert f"perseus-ext frontier: {len(frontier.plans)} of its {total} plans" in labels
    assert "wait-aware plans (iteration held to a deadline): the other 3" in labels


def test_savings_series_with_equal_values_share_a_line_and_the_axis_starts_at_zero(tmp_path, monkeypatch):
    """Five legend entries over four lines: one series hid another."""
    drawn = _captured(monkeypatch)
    factors = [1.0, 1.2, 1.5]
    savings = {"perseus-ext": [0.15, 0.28, 0.29], "stopping at T*": [0.15, 0.28, 0.29],
               "global clock": [0.0, 0.25, 0.27], "paper": [float("nan"), 0.27, float("nan")]}
    plotting.plot_savings(factors, savings, tmp_path / "savings.png")
    axis = drawn["figure"].axes[0]
    lines = axis.get_lines()
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert len(lines) == len(labels) == 3
    assert labels[0] == "perseus-ext = stopping at T*"
    assert len({line.get_linestyle() for line in lines}) == 3
    assert axis.get_ylim()[0] == 0
