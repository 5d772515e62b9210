"""Locating the energy counter's updates from reads at computation boundaries, and the windows
of exactly known energy between them (the online profiler's measurements, `runtime/profiler.py`).

The counter is coarse (it changes every ~100 ms). In a pipeline, reads come only at computation
boundaries, often 30-250 ms apart, so one read interval says little; but updates come at a
steady period, and the period and phase that put an update in every interval whose reads differ
and in none whose reads agree pin every update down to about a millisecond (`locate_updates`).
Consecutive located updates delimit windows; each holds known amounts of computing time per
label (computations cut by a boundary count fractionally), which `EnergyEstimator` solves for.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from perseus_ext.measurement.windows import WindowRecord

PERIOD_REFITS = 3  # rounds of re-rounding update ordinals against the midpoint fit
PERIOD_SEARCH_FACTOR = 2.0  # the first period search spans the midpoint fit / 2 to x 2
ZOOM_START_PERIODS = 16  # the period search starts on this many counter periods of the run
ZOOM_START_INTERVALS = 64  # and on at least this many read intervals
ZOOM_MARGIN_S = 0.03  # each zoom searches periods that drift this much over the previous stretch
PHASE_RESOLUTION_S = 0.0005  # phase bins and period steps resolve updates to this
PHASE_BINS = 200  # phase bins per counter period (0.5 ms at NVML's 100 ms)
MAX_PERIOD_CANDIDATES = 4001
MAX_PERIOD_RANGES = 8  # separate best-scoring period ranges followed into the next zoom


def _rough_period(mids: np.ndarray) -> tuple[float, float]:
    """(period, phase) of a line through the change midpoints, ordinals refined by rounding."""
    period = float(np.median(np.diff(mids)))
    if period <= 0:
        return period, float(mids[0])
    # Count updates step by step (a gap of ~2 periods means a missed update), so a small error
    # in the first period estimate cannot accumulate over a long run; then re-round against the fit.
    steps = np.maximum(1.0, np.round(np.diff(mids) / period))
    ordinals = np.concatenate([[0.0], np.cumsum(steps)])
    phase = float(mids[0])
    for _ in range(PERIOD_REFITS):
        period, phase = (float(v) for v in np.polyfit(ordinals, mids, 1))
        ordinals = np.round((mids - phase) / period)
    return period, phase


def _arc_scores(after: np.ndarray, width: np.ndarray, sign: np.ndarray, period: float,
                origin: float) -> np.ndarray:
    """Per phase bin of [0, period): +1 for each change interval holding a tick at that phase,
    -1 for each quiet interval holding one. Intervals as long as a period hold one at every
    phase: they count too, so that scores of different periods compare."""
    bins = PHASE_BINS
    keep = width < period
    always = float(np.sum(sign[~keep]))
    first = np.floor(((after[keep] - origin) % period) / period * bins).astype(int) + 1
    last = np.floor(((after[keep] + width[keep] - origin) % period) / period * bins).astype(int)
    last = np.where(last < first - 1, last + bins, last)  # arcs that wrap past the period
    delta = np.zeros(2 * bins + 2)
    np.add.at(delta, first, sign[keep])
    np.add.at(delta, last + 1, -sign[keep])
    covered = np.cumsum(delta)[: 2 * bins]
    return covered[:bins] + covered[bins:] + always


def _best_phase(scores: np.ndarray, period: float) -> float:
    """Centre of the circular run of top-scoring bins around the best one."""
    bins = len(scores)
    best = int(np.argmax(scores))
    top = scores[best]
    low = best
    while scores[(low - 1) % bins] == top and best - low < bins - 1:
        low -= 1
    high = best
    while scores[(high + 1) % bins] == top and high - low < bins - 1:
        high += 1
    return ((low + high + 1) / 2 / bins) * period


def locate_updates(changes: list[tuple[float, float]],
                   quiet: Sequence[tuple[float, float]] = ()) -> list[float]:
    """Times of counter updates: for each (after, at] of `changes` (at least one update lies
    in it), the last update at or before `at`, which is when the value read at `at` was set;
    clipped into the interval where the steady-period fit disagrees with it."""
    located, _ = _located_updates(changes, quiet)
    return located


def _located_updates(changes: list[tuple[float, float]],
                     quiet: Sequence[tuple[float, float]]) -> tuple[list[float], list[bool]]:
    """`locate_updates` plus, per change, whether the fitted update surely lies in its interval
    (not outside it, nor so close to an end that a neighbouring update might be the one).

    The counter updates on a steady period. Reads come only at computation boundaries, so a
    change is often known only to a 30-100 ms interval and a midpoint fit is off by tens of
    ms; instead the period and phase are the ones that put an update in the most `changes`
    and in the fewest `quiet` intervals (read pairs without a change), found by zooming in from
    the midpoint fit. The intersection of these intervals pins the updates down to about a
    millisecond, and the few stale reads (a counter that trails its device) are outvoted.
    Without quiet intervals, nothing rules out a shorter period: the midpoint fit is used.
    """
    mids = np.array([(a + b) / 2 for a, b in changes])
    if len(mids) < 3:
        return mids.tolist(), [True] * len(mids)
    period, phase = _rough_period(mids)
    if period <= 0:
        return mids.tolist(), [True] * len(mids)
    low = np.array([a for a, _ in changes])
    high = np.array([b for _, b in changes])
    if quiet:
        period, phase = _zoomed_period(changes, quiet, period)
        last = phase + np.floor((high - phase) / period) * period  # the last update up to the read
        # ... or, where that falls before the interval, the next one if the phase's resolution
        # allows it to lie just inside.
        just_after = (last <= low) & (last + period <= high + PHASE_RESOLUTION_S)
        last = np.where(just_after, last + period, last)
    else:  # each change's own fitted update: the midpoint fit is too coarse to take the last one
        last = phase + np.round((mids - phase) / period) * period
    consistent = (last > low) & (last <= high)
    if quiet:  # an update within the phase's resolution of a read may lie on either side of it
        tolerance = PHASE_RESOLUTION_S
        consistent = (last > low - tolerance) & (last <= high + tolerance) \
            & (np.abs(last - low) > tolerance) & (np.abs(last - high) > tolerance) \
            & (last + period > high + tolerance)
    return np.clip(last, low, high).tolist(), consistent.tolist()


def _zoomed_period(changes: list[tuple[float, float]], quiet: Sequence[tuple[float, float]],
                   rough: float) -> tuple[float, float]:
    """(period, phase) that put an update in the most changes and fewest quiet intervals."""
    intervals = sorted([(a, b, 1.0) for a, b in changes] + [(a, b, -1.0) for a, b in quiet])
    after = np.array([a for a, _, _ in intervals])
    width = np.array([b - a for a, b, _ in intervals])
    sign = np.array([v for _, _, v in intervals])
    origin = float(after[0])
    # Zoom in on the period: first over a short stretch of the run, from the longest quiet
    # interval (no update in it, so the period is longer) to twice the midpoint fit (sparse
    # reads put that fit tens of percent off), then over stretches twice as long around every
    # range of periods that scored best so far (a short stretch may not tell them apart); each
    # grid is fine enough that the updates drift by at most PHASE_RESOLUTION_S over its stretch.
    quiet_width = float(np.max(width[sign < 0], initial=0.0))
    ranges = [(max(quiet_width, rough / PERIOD_SEARCH_FACTOR), rough * PERIOD_SEARCH_FACTOR)]
    ends = np.sort(after + width)
    span = min(max(ZOOM_START_PERIODS * rough, float(ends[min(ZOOM_START_INTERVALS, len(ends)) - 1]) - origin),
               float(ends[-1]) - origin)
    while True:
        inside = after + width <= origin + span
        step = PHASE_RESOLUTION_S * rough / max(span, rough)
        budget = MAX_PERIOD_CANDIDATES // len(ranges)
        candidates = np.concatenate([np.linspace(low, high, min(budget, math.ceil((high - low) / step) + 1))
                                     for low, high in ranges])
        scores = np.array([np.max(_arc_scores(after[inside], width[inside], sign[inside], p, origin))
                           for p in candidates])
        best = candidates[scores == scores.max()]
        if inside.all():  # the midpoint fit if it is among the best, else the best range's middle
            runs = np.split(best, np.flatnonzero(np.diff(best) > 2 * step) + 1)
            run = min(runs, key=lambda r: abs(float(np.median(r)) - rough))
            period = rough if run[0] - step <= rough <= run[-1] + step else float(np.median(run))
            break
        margin = ZOOM_MARGIN_S * float(best.max()) / span  # this far off, updates drift out of the stretch
        clusters = np.split(best, np.flatnonzero(np.diff(best) > 2 * margin) + 1)
        ranges = [(float(c.min()) - margin, float(c.max()) + margin) for c in clusters[:MAX_PERIOD_RANGES]]
        span *= 2
    return period, origin + _best_phase(_arc_scores(after, width, sign, period, origin), period)


def build_windows(
    reads: list[tuple[float, int | None]], computations: list[tuple[str, float, float]]
) -> list[WindowRecord]:
    """Windows between consecutive counter updates, with the computations they contain.

    A computation cut by a window boundary counts fractionally (by time) on both sides; a
    failed read (None) ends the current run of windows.
    """
    runs: list[list[tuple[float, float, int]]] = [[]]  # per run: (after, at, value) of each change
    quiet: list[list[tuple[float, float]]] = [[]]  # per run: read pairs without a change
    previous: tuple[float, int] | None = None
    for timestamp, value in reads:
        if value is None:
            previous = None
            runs.append([])
            quiet.append([])
            continue
        if previous is not None and value != previous[1]:
            runs[-1].append((previous[0], timestamp, value))
        elif previous is not None and timestamp > previous[0]:
            quiet[-1].append((previous[0], timestamp))
        previous = (timestamp, value)
    starts = np.array([start for _, start, _ in computations])
    ends = np.array([end for _, _, end in computations])
    labels = [label for label, _, _ in computations]
    records = []
    for changes, unchanged in zip(runs, quiet):
        if len(changes) < 2:
            continue
        times, consistent = _located_updates([(a, b) for a, b, _ in changes], unchanged)
        # A change whose interval holds no fitted update (a stale read) bounds no window: its
        # neighbours' window spans it, and the energy between their values is still exact.
        bounds = [(time, change) for time, change, ok in zip(times, changes, consistent) if ok]
        for (begin, first), (end, second) in zip(bounds, bounds[1:]):
            overlap = np.clip(np.minimum(ends, end) - np.maximum(starts, begin), 0.0, None)
            counts: dict[str, float] = {}
            busy: dict[str, float] = {}
            for index in np.flatnonzero(overlap > 0):
                label = labels[index]
                length = ends[index] - starts[index]
                counts[label] = counts.get(label, 0.0) + overlap[index] / length
                busy[label] = busy.get(label, 0.0) + overlap[index]
            records.append(WindowRecord(counts, end - begin, (second[2] - first[2]) / 1000.0, busy))
    return records
