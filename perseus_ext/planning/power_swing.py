"""Power swing: how much, and how fast, a periodic power trace moves around its mean.

Grid operators and datacenters cap the swing of a training job's power (thousands of GPUs in
lockstep rise and fall together every iteration) and its ramp rate. These are the figures
perseus-ext reports and bounds, defined once here (docs/power.md explains how to read them).
Every figure reads the trace as ONE PERIOD of a periodic signal: iterations run back to back,
so the last sample is followed by the first again (the moving average and the spectrum wrap).

* `mean_w`: the trace's mean, W.
* `peak_to_trough_w`: highest sample minus lowest sample, W. On the planner's model the
  samples are 1 ms averages of an exact piecewise-constant trace, so the figure is the swing
  the site sees at 1 ms resolution.
* `peak_to_trough_fraction`: `peak_to_trough_w / mean_w` (0 for an all-zero trace).
* `max_ramp_w_per_s`: the largest absolute slope, W/s, of the trace's 50 ms moving average (the
  ramp a power system responds to; an instant step of D watts ramps at D / 0.05 s). The window
  is `round(0.05 s / sample_period_s)` samples, at least one, at most the whole period; the
  slope between consecutive samples of a w-sample moving average is (p[i] - p[i-w]) / (w dt).
* `band_energy_w2`: the power's variance (W²) carried by frequencies in the 0.1–20 Hz band,
  where grid and generator oscillation modes live, from the FFT of the periodic trace
  (Parseval: the variance is the sum of the squared FFT magnitudes over the non-zero
  frequencies, divided by N²). A trace of period P has components at k / P only, so a trace
  shorter than 10 s has no energy below 0.1 Hz.
* `band_energy_fraction`: `band_energy_w2` / the whole variance (0 for a constant trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RAMP_WINDOW_S = 0.05
BAND_LOW_HZ = 0.1
BAND_HIGH_HZ = 20.0


@dataclass(frozen=True)
class SwingFigures:
    """The swing figures of one periodic power trace (definitions: the module docstring)."""

    mean_w: float
    peak_to_trough_w: float
    peak_to_trough_fraction: float  # of the mean
    max_ramp_w_per_s: float  # largest slope of the 50 ms moving average
    band_energy_w2: float  # power variance in the 0.1-20 Hz band
    band_energy_fraction: float  # of the whole variance


def swing_figures(power_w: np.ndarray, sample_period_s: float) -> SwingFigures:
    """The swing figures of `power_w`, one period of a periodic trace sampled every
    `sample_period_s` seconds (iterations back to back: the trace wraps around).

    Raises ValueError naming the argument when the trace is empty, not one-dimensional, not
    finite or negative, or the sample period is not a positive finite number of seconds.
    """
    power = np.asarray(power_w, dtype=float)
    if power.ndim != 1 or power.size == 0:
        raise ValueError(f"power_w must be a non-empty 1-D array of watts, got shape {power.shape}")
    if not np.all(np.isfinite(power)) or np.any(power < 0):
        raise ValueError("power_w must hold finite watts >= 0 (drop or fill missing samples first)")
    if not (np.isfinite(sample_period_s) and sample_period_s > 0):
        raise ValueError(f"sample_period_s must be a positive number of seconds, got {sample_period_s!r}")
    n = power.size
    mean = float(power.mean())
    peak_to_trough = float(power.max() - power.min())

    window = int(min(n, max(1, round(RAMP_WINDOW_S / sample_period_s))))
    slope = (power - np.roll(power, window)) / (window * sample_period_s)
    max_ramp = float(np.abs(slope).max())

    spectrum = np.fft.rfft(power - mean)
    weight = np.full(spectrum.size, 2.0)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0  # the Nyquist bin of an even length has no mirror
    variance_by_bin = weight * np.abs(spectrum) ** 2 / n**2
    frequency_hz = np.fft.rfftfreq(n, sample_period_s)
    in_band = (frequency_hz >= BAND_LOW_HZ) & (frequency_hz <= BAND_HIGH_HZ)
    band = float(variance_by_bin[in_band].sum())
    total = float(variance_by_bin[1:].sum())
    return SwingFigures(
        mean_w=mean,
        peak_to_trough_w=peak_to_trough,
        peak_to_trough_fraction=peak_to_trough / mean if mean > 0 else 0.0,
        max_ramp_w_per_s=max_ramp,
        band_energy_w2=band,
        band_energy_fraction=band / total if total > 0 else 0.0,
    )


# ------------------------------------------------------------------------------ the planning model
MODEL_SAMPLE_PERIOD_S = 1e-3  # the planner's traces are read as 1 ms averages


@dataclass(frozen=True, eq=False)
class PowerTrace:
    """The exact piecewise-constant power of one pipeline over one iteration (planning model).

    Segment k lasts from `breakpoints_s[k]` to `breakpoints_s[k + 1]` at `power_w[k]`; the
    first breakpoint is 0 and the last the iteration time (the period: iterations run back to
    back). Energy is exactly the integral, so it equals the plan's replayed energy.
    """

    breakpoints_s: np.ndarray
    power_w: np.ndarray

    @property
    def period_s(self) -> float:
        return float(self.breakpoints_s[-1])

    @property
    def energy_j(self) -> float:
        return float(np.dot(np.diff(self.breakpoints_s), self.power_w))

    def sampled(self, sample_period_s: float = MODEL_SAMPLE_PERIOD_S) -> tuple[np.ndarray, float]:
        """(power averaged over each of N equal bins, bin width): N = the period / the asked
        period, rounded, so the bins tile exactly one period (the trace stays periodic)."""
        bins = max(1, round(self.period_s / sample_period_s))
        edges = np.linspace(0.0, self.period_s, bins + 1)
        cumulative = np.concatenate([[0.0], np.cumsum(np.diff(self.breakpoints_s) * self.power_w)])
        width = self.period_s / bins
        return np.diff(np.interp(edges, self.breakpoints_s, cumulative)) / width, width

    def figures(self, sample_period_s: float = MODEL_SAMPLE_PERIOD_S) -> SwingFigures:
        """The swing figures of this trace read as `sample_period_s` averages."""
        power, width = self.sampled(sample_period_s)
        return swing_figures(power, width)


def piecewise_power(
    starts_s: np.ndarray, finishes_s: np.ndarray, busy_power_w: np.ndarray, idle_power_w: float,
    num_gpus: int, period_s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments of the pipeline power of plans given as columns: each computation i draws
    `busy_power_w[i]` from `starts_s[i]` to `finishes_s[i]`, a GPU not computing draws
    `idle_power_w`, `num_gpus` GPUs in all (computations of one GPU never overlap).

    Inputs are (computations, plans); returns, one row per plan (plan-major: the sort runs
    along contiguous rows), the breakpoints (plans, 2N + 2) from 0 to the plan's period, the
    power of the segment starting at each breakpoint (plans, 2N + 1) and the GPUs computing
    in it. Segments may have zero length (simultaneous events; there a GPU may be counted
    twice, finishing and starting).
    """
    plans = starts_s.shape[1]
    excess = (busy_power_w - idle_power_w).T
    zeros = np.zeros((plans, 1))
    times = np.concatenate([zeros, starts_s.T, finishes_s.T], axis=1)
    order = np.argsort(times, axis=1)
    times = np.take_along_axis(times, order, axis=1)
    deltas = np.take_along_axis(np.concatenate([zeros, excess, -excess], axis=1), order, axis=1)
    level = num_gpus * idle_power_w + np.cumsum(deltas, axis=1)
    count = np.concatenate([zeros, np.ones_like(excess), -np.ones_like(excess)], axis=1)
    busy = np.cumsum(np.take_along_axis(count, order, axis=1), axis=1)
    breakpoints = np.concatenate([times, np.asarray(period_s, dtype=float).reshape(plans, 1)], axis=1)
    return breakpoints, level, busy


def plan_power_traces(model, choices: np.ndarray) -> list[PowerTrace]:
    """The pipeline power traces of plans (option indices of `model`, a `CostModel`, shaped
    (N,) or (N, plans)): each computation draws its energy / its time (latency-aware when the
    model charges a clock-change latency), a waiting GPU the blocking power."""
    choices = np.asarray(choices)
    single = choices.ndim == 1
    columns = choices[:, None] if single else choices
    starts, finishes, power = computation_power(model, columns)
    breakpoints, level, _ = piecewise_power(
        starts, finishes, power, model.blocking_power, model.num_stage_gpus, finishes.max(axis=0)
    )
    return [PowerTrace(breakpoints[j], level[j]) for j in range(columns.shape[1])]


def computation_power(model, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, finishes, power) of every computation of plans (N, plans) on a `CostModel`:
    starts as early as the DAG allows, as every replay of the model."""
    if model.switch_latency_s > 0:
        trace = model.latency_trace(choices)
        finishes, durations, energies = trace.finish, trace.durations, trace.node_energies
    else:
        rows = np.arange(model.num_nodes)[:, None]
        durations, energies = model.times[rows, choices], model.energies[rows, choices]
        finishes = model.dag.finish_times(durations)
    return finishes - durations, finishes, energies / durations


@dataclass(frozen=True)
class FrontierSwing:
    """The pipeline swing of every plan of a frontier, in its order, and of all-max clocks."""

    reference: SwingFigures  # every computation at its fastest clock
    plans: tuple[SwingFigures, ...]

    def fractions(self) -> np.ndarray:
        """Each plan's peak-to-trough swing as a fraction of the all-max-clock plan's."""
        return np.array([f.peak_to_trough_w for f in self.plans]) / self.reference.peak_to_trough_w


def frontier_swing(frontier, schedule, profile, switch_latency_s: float = 0.0) -> FrontierSwing:
    """The planning model's swing figures of a `Frontier`'s plans (solved for `schedule` on
    `profile`): every measured clock is in the model, so any plan's clocks are found."""
    from perseus_ext.planning.energy import CostModel

    model = CostModel(schedule, profile, frontier.blocking_power, switch_latency_s)
    reference = plan_power_traces(model, model.fastest_choice())[0]
    figures = []
    for first in range(0, len(frontier.plans), _PLANS_AT_ONCE):
        choices = choices_of(model, frontier.plans[first : first + _PLANS_AT_ONCE])
        figures += [trace.figures() for trace in plan_power_traces(model, choices)]
    return FrontierSwing(reference.figures(), tuple(figures))


_PLANS_AT_ONCE = 256


def choices_of(model, plans) -> np.ndarray:
    """Option indices (N, plans) of `Plan`s' clocks on a `CostModel` (`CostModel.choice_of`
    for many plans at once: a frontier of 8 x 96 holds ~2,000 plans of 1,536 clocks)."""
    from perseus_ext.errors import ProfileError

    clocks = np.empty((model.num_nodes, len(plans)), dtype=np.int64)
    for stage, positions in enumerate(model.dag.stage_positions):
        clocks[positions] = np.stack([plan.frequencies[stage, : len(positions)] for plan in plans], axis=1)
    match = model.frequencies[:, None, :] == clocks[:, :, None]
    match &= np.arange(model.frequencies.shape[1]) < model.num_options[:, None, None]
    if not match.any(axis=2).all():
        node, plan = np.argwhere(~match.any(axis=2))[0]
        raise ProfileError(f"plan {plan}'s clock {clocks[node, plan]} MHz is not in stage "
                           f"{model.dag.stage[node]}'s profile")
    return match.argmax(axis=2)
