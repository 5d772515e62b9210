"""Figures for frontiers, pipeline timelines and emulated savings.

matplotlib is an optional dependency (`pip install perseus-ext[plot]`): it is imported inside
the functions, so the planner and runtime work without it. Figures are built on
`matplotlib.figure.Figure` with the Agg canvas rather than through pyplot, so plotting never
switches the caller's backend or opens a window, and is safe from any thread. The file type
follows the path's suffix (.png, .svg, .pdf).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

import numpy as np

from perseus_ext.errors import PerseusError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.schedule import Kind

if TYPE_CHECKING:  # matplotlib is optional: imported when a figure is drawn
    from matplotlib.figure import Figure

# A timeline panel is a Plan or a raw option-index choice of a CostModel.
TimelineInput = Union[Plan, np.ndarray]

SUPPORTED_SUFFIXES = (".png", ".svg", ".pdf")
BAR_LABEL_LIMIT = 400  # above this many computations per panel, bar labels would overlap
LABEL_WIDTH_PER_CHAR = 0.0055  # share of the time axis one 6-pt character takes on the figure
LIGHT_COLOR_ABOVE = 0.6  # viridis is light above this normalised clock: label bars in black


class PlottingError(PerseusError, RuntimeError):
    """A figure cannot be made: matplotlib missing, or an unsupported output path."""


def _new_figure(width: float, height: float) -> "Figure":
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlottingError(
            "plotting needs matplotlib; install it with `pip install perseus-ext[plot]`"
        ) from None
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise PlottingError(
            f"cannot write a figure to {path}: use a file name ending in "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _save(figure: "Figure", path: Path) -> None:
    figure.savefig(path, dpi=150)


def _energy_unit(joules: float) -> tuple[str, float]:
    """Largest of J/kJ/MJ/GJ that keeps `joules` at >= 1, so labels stay short."""
    for unit, scale in (("GJ", 1e9), ("MJ", 1e6), ("kJ", 1e3)):
        if abs(joules) >= scale:
            return unit, scale
    return "J", 1.0


def plot_frontier(
    frontier: Frontier,
    path: str | Path,
    *,
    marks: Mapping[str, Plan] | None = None,
    title: str | None = None,
    swing_fractions: Sequence[float] | None = None,
    capped: Frontier | None = None,
    capped_label: str | None = None,
) -> None:
    """Iteration time vs energy of every frontier plan, with the baseline (every computation
    at its fastest clock: all max clock unless a top clock was measured slower than a lower one).

    `swing_fractions`: each plan's pipeline power swing as a fraction of the all-max-clock
    plan's (`power_swing.FrontierSwing.fractions`), drawn on a right-hand axis; `capped`: a
    swing-capped frontier drawn as its own series (`capped_label`).

    `marks` labels plans worth pointing at (e.g. {"deployed": plan, "straggler": plan}); a
    marked plan need not be on the frontier (a Zeus-style global clock, say).
    """
    path = _check_path(path)
    figure = _new_figure(7.0, 4.8)
    ax = figure.add_subplot()
    unit, scale = _energy_unit(frontier.baseline.energy)
    ordinary = frontier.ordinary_plans
    times = np.array([p.time for p in ordinary])
    energies = np.array([p.energy for p in ordinary]) / scale
    ax.plot(times, energies, "-", color="tab:blue", lw=1.5, zorder=2)
    total = len(frontier.plans)  # the count the console and the summary print
    ax.plot(times, energies, "o", color="tab:blue", ms=2.5, zorder=2,
            label=f"perseus-ext frontier: {len(ordinary)} of its {total} plans" if len(ordinary) < total
            else f"perseus-ext frontier: {total} plans")
    extension = frontier.plans[len(ordinary):]
    if extension:
        # Its own series: these plans are chosen by energy - blocking power x stages x time
        # (an iteration held to a deadline), so in one line with the ordinary plans it would
        # jump back in time and zig-zag.
        ax.plot([p.time for p in extension], [p.energy / scale for p in extension], "s-",
                color="tab:cyan", ms=2.0, lw=0.8, zorder=1,
                label=f"wait-aware plans (iteration held to a deadline): the other {len(extension)}")
    base = frontier.baseline
    ax.plot(base.time, base.energy / scale, "X", color="black", ms=10, zorder=4,
            label=f"baseline, fastest clocks: {base.time:.4g} s, {base.energy / scale:.4g} {unit}")
    fast = frontier.fastest
    saving = frontier.intrinsic_saving()
    ax.plot(fast.time, fast.energy / scale, "D", color="tab:green", ms=8, zorder=4,
            label=f"fastest plan: {fast.time:.4g} s, {fast.energy / scale:.4g} {unit} "
            f"({saving:.1%} less)")
    colors = ["tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for k, (label, plan) in enumerate((marks or {}).items()):
        color = colors[k % len(colors)]
        ax.plot(plan.time, plan.energy / scale, "*", color=color, ms=14, zorder=5,
                markeredgecolor="black", markeredgewidth=0.5,
                label=f"{label}: {plan.time:.4g} s, {plan.energy / scale:.4g} {unit}")
    if capped is not None:
        ax.plot([p.time for p in capped.plans], [p.energy / scale for p in capped.plans], "^-", color="tab:red",
                ms=2.5, lw=1.0, zorder=3, label=f"{capped_label or 'swing-capped'}: {len(capped.plans)} plans")
    if swing_fractions is not None:
        right = ax.twinx()
        right.plot(times, 100 * np.asarray(swing_fractions, dtype=float)[: len(ordinary)], ":", color="tab:gray",
                   lw=1.2, label="pipeline swing, % of all-max (right axis)")
        right.set_ylabel("pipeline power swing (% of all max clock)")
        right.set_ylim(0, 130)
        right.legend(fontsize=8, loc="lower right", framealpha=0.9)
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel(f"energy per iteration ({unit})")
    schedule = frontier.schedule
    ax.set_title(title or (
        f"Iteration time–energy frontier: {schedule.kind.value}, "
        f"{schedule.stages} stages, {schedule.microbatches} microbatches"
    ))
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.04, y=0.08)
    # From zero: a savings of 10-25 % must look like one, not fill the whole axis.
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom for the legend above the curve
    ax.legend(fontsize=8, loc="lower left", framealpha=0.9)
    _save(figure, path)


def _timeline_choice(cost_model: CostModel, entry: TimelineInput) -> np.ndarray:
    if isinstance(entry, Plan):
        return cost_model.choice_of(entry)
    choice = np.asarray(entry, dtype=np.int64)
    if choice.shape != (cost_model.num_nodes,):
        raise PlottingError(
            f"a timeline choice must have one option index per computation, shape "
            f"({cost_model.num_nodes},); got shape {choice.shape}"
        )
    return choice


def plot_timeline(
    cost_model: CostModel,
    plans: TimelineInput | Sequence[TimelineInput] | Mapping[str, TimelineInput],
    path: str | Path,
    *,
    title: str | None = None,
    slowdowns: Sequence[float] | None = None,
) -> None:
    """Pipeline Gantt chart, one row per stage, bars coloured by SM clock.

    `plans` is one plan (or option-index choice), a list, or a {panel title: plan} mapping —
    e.g. {"before": all-max-clock, "after": deployed plan} — drawn as stacked panels on one
    time axis and one colour scale. Computations start as soon as their dependencies finish,
    as the pipeline runs them. `slowdowns` (one per panel, optional) draws the iteration time
    of a straggler pipeline as a dashed line, so a panel shows the wait it has to fill.
    """
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    path = _check_path(path)
    if isinstance(plans, (Plan, np.ndarray)):
        panels = {"": plans}
    elif isinstance(plans, Mapping):
        panels = dict(plans)
    else:
        panels = {f"plan {k}": p for k, p in enumerate(plans)}
    if not panels:
        raise PlottingError("plot_timeline needs at least one plan")
    if slowdowns is not None and len(slowdowns) != len(panels):
        raise PlottingError(f"got {len(slowdowns)} slowdowns for {len(panels)} timeline panels")

    dag = cost_model.dag
    rows = np.arange(cost_model.num_nodes)
    drawn = []
    for label, entry in panels.items():
        choice = _timeline_choice(cost_model, entry)
        durations = cost_model.times[rows, choice]
        finish = dag.finish_times(durations)
        energy = float(cost_model.replay(choice)[1])
        drawn.append(
            (label, finish - durations, durations, cost_model.frequencies[rows, choice], energy)
        )
    valid = cost_model.frequencies[cost_model.frequencies > 0]
    norm = Normalize(vmin=int(valid.min()), vmax=int(valid.max()))
    cmap = colormaps["viridis"]
    horizon = max(float((start + dur).max()) for _, start, dur, _, _ in drawn)
    if slowdowns is not None:
        horizon = max(horizon, max(slowdowns))

    num_stages = dag.num_stages
    height = 0.6 + len(panels) * (0.35 * num_stages + 0.9)
    figure = _new_figure(11.0, height)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    label_bars = cost_model.num_nodes <= BAR_LABEL_LIMIT
    for k, (ax, (label, start, dur, freq, energy)) in enumerate(zip(axes, drawn)):
        for kind, hatch in ((Kind.FORWARD, None), (Kind.BACKWARD, "///")):
            mask = np.array([c.kind is kind for c in dag.computations])
            ax.barh(dag.stage[mask], dur[mask], left=start[mask], height=0.8,
                    color=cmap(norm(freq[mask])), edgecolor="white",
                    linewidth=0.3 if label_bars else 0,
                    hatch=hatch if label_bars else None)
        if label_bars:
            for i, c in enumerate(dag.computations):
                letter = "F" if c.kind is Kind.FORWARD else "B"
                chunk = f"c{c.chunk}" if cost_model.schedule.num_chunks > 1 else ""
                bar_label = f"{letter}{c.microbatch}{chunk}"
                if dur[i] < LABEL_WIDTH_PER_CHAR * len(bar_label) * horizon:
                    continue  # the label would spill over its neighbours
                light_bar = norm(freq[i]) > LIGHT_COLOR_ABOVE
                ax.text(start[i] + dur[i] / 2, c.stage, bar_label, ha="center", va="center",
                        fontsize=6, color="black" if light_bar else "white")
        makespan = float((start + dur).max())
        ax.axvline(makespan, color="black", lw=1)
        unit, scale = _energy_unit(energy)
        text = f"{label}: " if label else ""
        text += f"T = {makespan:.4g} s (solid line), E = {energy / scale:.5g} {unit}"
        if slowdowns is not None:
            ax.axvline(slowdowns[k], color="tab:red", lw=1.2, ls="--")
            text += f"; straggler pipeline's T' = {slowdowns[k]:.4g} s (red dashed line)"
        ax.set_title(text, fontsize=10, loc="left")
        ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
        ax.set_ylim(num_stages - 0.5, -0.5)
        ax.set_xlim(0, horizon * 1.01)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("time within the iteration (s)")
    bar = figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), pad=0.01,
                          aspect=max(10, 12 * len(panels)))
    bar.set_label("SM clock (MHz)")
    suffix = "  (hatched: backward)" if label_bars else ""
    figure.suptitle((title or "Pipeline timeline") + suffix)
    _save(figure, path)


def plot_savings(
    slowdowns: Sequence[float],
    savings: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    title: str | None = None,
    ylabel: str = "energy saving vs all max clock",
) -> None:
    """Energy saving (fractions, 0.1 = 10%) of each series against the straggler slowdown T'/T,
    on an axis from zero. Series with the same values share one line and one legend entry
    ('A = B'), so no line hides another."""
    from matplotlib.ticker import PercentFormatter

    path = _check_path(path)
    x = np.asarray(slowdowns, dtype=float)
    if not len(x):
        raise PlottingError("plot_savings needs at least one slowdown factor")
    figure = _new_figure(7.0, 4.5)
    ax = figure.add_subplot()
    markers = "osD^vP*X"
    styles = ("-", "--", "-.", ":")
    drawn: list[tuple[np.ndarray, list[str]]] = []  # series with equal values share one line
    for label, values in savings.items():
        y = np.asarray(values, dtype=float)
        if y.shape != x.shape:
            raise PlottingError(
                f"series {label!r} has {y.size} savings for {x.size} slowdown factors"
            )
        same = next((labels for other, labels in drawn if np.allclose(other, y, atol=5e-5, equal_nan=True)), None)
        if same is None:
            drawn.append((y, [label]))
        else:
            same.append(label)
    for k, (y, labels) in enumerate(drawn):
        ax.plot(x, y * 100, marker=markers[k % len(markers)], ls=styles[k % len(styles)], ms=5,
                label=" = ".join(labels))
    low = min(0.0, float(np.nanmin([y.min() for y, _ in drawn])) * 100)
    ax.set_ylim(low, max(ax.get_ylim()[1], 1.0))  # from zero: savings compared by their size
    ax.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    ax.set_xlabel("straggler slowdown T'/T")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "Energy saving vs straggler slowdown")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(figure, path)


# Line colours no phase band uses (the bands are grey, yellow, light blue, greens, reds).
SERIES_STYLES = (("black", "-"), ("tab:purple", "--"), ("tab:brown", ":"), ("tab:olive", "-."))
PHASE_COLORS = {"warmup": "#bbbbbb", "profiling": "#f2c14e", "solving": "#7fb7e6", "deployed": "#9fd89f",
                "power_limit": "#9fd89f", "observing": "#eeeeee", "deployed (slowed for a straggler)": "#3f9b3f",
                "baseline probe": "#d62728", "fallback": "#f4a6a6"}


def plot_run_timeline(
    series: Mapping[str, Mapping[str, Sequence[float]]],
    phases: Sequence[str],
    path: str | Path,
    *,
    straggler: tuple[int, int] | None = None,
    title: str = "perseus-ext run: time and energy per iteration",
) -> Path:
    """Per-iteration time and energy of one or more runs (`series[name] = {"time_s": [...],
    "energy_j": [...]}`), over bands showing the lifecycle phase of each iteration (`phases`:
    warm-up, profiling, solving, deployed, ...) and an optional straggler window, so the cost of
    profiling and solving is visible and never mistaken for the saving.

    The y axes start at zero and end just above the iterations outside profiling (profiling at
    low clocks runs up to several times slower and would squash the differences between runs
    that the plot is for); a profiling peak off scale is pointed at on the panel. Lines use
    colours no phase band uses. The legend sits below the panels, where it covers no data."""
    path = _check_path(path)
    figure = _new_figure(9.0, 6.2)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for axis in (top, bottom):
        start = 0
        for index in range(1, len(phases) + 1):
            if index == len(phases) or phases[index] != phases[start]:
                axis.axvspan(start - 0.5, index - 0.5, color=PHASE_COLORS.get(phases[start], "#ffffff"),
                             alpha=0.45, linewidth=0, label=phases[start] if axis is top else None)
                start = index
        if straggler is not None:
            axis.axvspan(straggler[0] - 0.5, straggler[1] - 0.5, fill=False, hatch="//", edgecolor="#d9822b",
                         linewidth=0, label="straggler" if axis is top else None)
    for (color, style), (name, figures) in zip(SERIES_STYLES, series.items()):
        top.plot(figures["time_s"], color=color, ls=style, label=name, linewidth=1)
        bottom.plot(figures["energy_j"], color=color, ls=style, label=name, linewidth=1)
    top.set_ylabel("time / iteration (s)")
    bottom.set_ylabel("energy / iteration (J)")
    bottom.set_xlabel("iteration")
    for axis, key, unit in ((top, "time_s", "s"), (bottom, "energy_j", "J")):
        _scale_past_profiling(axis, [figures[key] for figures in series.values()], phases, unit)
    handles, labels = top.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    figure.legend(unique.values(), unique.keys(), fontsize=7, ncol=5, loc="outside lower center", frameon=False)
    top.set_title(title, fontsize=10)
    _save(figure, path)
    return path


def _scale_past_profiling(axis: Any, runs: Sequence[Sequence[float | None]], phases: Sequence[str], unit: str) -> None:
    """Y limits from zero to just above the iterations outside profiling: from zero, so that
    noise of 2 % looks like 2 % and not like spikes, and a saving like its size; profiling at
    low clocks runs several times slower and would squash every other iteration, so its
    iterations above the top are clipped and each profiling band says how high it went."""
    kept, peaks = [], {}
    for values in runs:
        for index, value in enumerate(values):
            if value is None or not np.isfinite(value):
                continue
            if index < len(phases) and phases[index] == "profiling":
                peaks[index] = max(peaks.get(index, value), value)
            else:
                kept.append(value)
    if not kept:
        return
    high = max(kept) * 1.15 or 1.0
    axis.set_ylim(0, high)
    clipped = {index: value for index, value in peaks.items() if value > high}
    if not clipped:
        return
    first, last = min(clipped), max(clipped)
    top = max(clipped.values())
    axis.annotate(f"profiling: up to {top:.3g} {unit} (off scale)", xy=((first + last) / 2, high),
                  xycoords="data", xytext=(0, -10), textcoords="offset points", ha="center", va="top",
                  fontsize=7, color="#8a6d00", arrowprops={"arrowstyle": "->", "color": "#8a6d00", "lw": 0.8})
