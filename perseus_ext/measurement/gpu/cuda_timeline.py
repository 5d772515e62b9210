"""The compute stream of a real GPU, seen through CUDA events.

A marker is a `torch.cuda.Event(enable_timing=True)` recorded on the current stream: recording
is asynchronous (the training thread never waits), and the controller's worker thread may block
on `event.synchronize()` to learn when the device got there.

Device times, for weeks of training. CUDA gives event-to-event elapsed times, not wall-clock
times, as a 32-bit float of milliseconds: measured from one event recorded when the job starts,
a marker's time would be quantised to 8 ms after a day and 64 ms after a week (the size of the
clock-switching latency and of the computations being timed). So markers are measured from an
*anchor*, an event the device has reached recently, and the anchor moves forward: to the
iteration start marker once the device has reached it (`anchor_at`, which the sequencer calls
at every iteration start), or to any marker noticed more than `ANCHOR_MAX_AGE_S` after it.
Nothing is synchronised for it: an anchor is a marker someone already waited for or queried.
Anchor-to-anchor elapsed times add up (float64) to a device clock `d` that never loses
precision; a link longer than `LONG_LINK_S` (its float32 rounding no longer negligible) starts
the offset estimate afresh.

The host/device offset. Every time the host notices a marker reached (a successful query or
wait) at perf_counter time n, n - d bounds the offset from above (the device got there no later
than the host noticed, and the notice comes some random delay later). The device's clock runs
at a rate against the host's that is off by tens of ppm, either way, and that rate wanders (the
host clock, CLOCK_MONOTONIC, is slewed by NTP; the device's oscillator follows its
temperature), a few ppm over hours. So the offset is fitted as the *lower envelope* of the
bounds over the last `WINDOW_S` of device time (a time window, so its span does not depend on
how long iterations are): the line, or once the bounds span `CURVED_SPAN_S` the parabola, that
lies below every bound and is as high as possible on average (the linear program of Moon,
Skelly and Towsley, "Estimation and removal of clock skew from network delay measurements",
INFOCOM 1999, with a curvature term for the wandering rate). With notice delays that are
one-sided, the envelope is pinned by the luckiest notices, not by their mean; the curvature
keeps a 20-minute window true when the rate changes by a few ppm an hour. Beyond the newest
bound the fit is extended along its tangent. The bounds are kept as the lowest of each
`BUCKET_S` of device time and the fit is refreshed every `REFIT_S` of device time (a small LP;
between fits a bound below the fit lowers it at once). After a long link (`LONG_LINK_S`, a pause
of the job) the estimate starts afresh from the pause on; markers before it keep the fit they
had.

After a pause. The first iterations after a pause leave a handful of bounds, and the envelope
of a handful tilts by tens of ppm whenever the earliest notices happen to be late and the
later ones early: 60 s further on, that is more than a millisecond. But the rate is not unknown
there: the pause itself measures its mean. The device time across the pause is one float32
link, off by half a unit in its last place (0.5 ms after 3 h), and the offset before it is the
old fit's, so the offset's change over the pause, divided by the pause, gives the rate's mean
over the pause to a fraction of a ppm; for a pause of minutes, where that quotient is noisy,
the rate before the pause weighs in (each by its precision). The rate at the pause's end
differs from that mean by as much as the rate wanders, so the young fit is the most likely
line under the notice delays' exponential distribution (mean: the old fit's residuals) and a
Gaussian prior on its rate around that centre, whose spread is how far the fitted rate has
wandered over the last day (at least `RATE_PRIOR_MIN_SD`): with few bounds the prior holds
the rate, and it gives way as the bounds span more (`_anchored_line`). The envelope of few
bounds also sits above the truth by about the least of their delays, so the young fit is
lowered by the mean delay over the number of bounds (the posterior mean of its level). Once
the bounds span `CURVED_SPAN_S` the ordinary fit takes over.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from typing import Any

from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline

POLL_S = 0.001  # query interval of a wait with a timeout (event.synchronize cannot time out); each query takes the GIL
ANCHOR_MAX_AGE_S = 10.0  # without iteration starts: any marker noticed this long after the anchor becomes one
# An anchor-to-anchor link this long restarts the offset estimate: its float32 milliseconds are
# rounded by up to 4 us at 120 s, but by up to 0.5 ms after a 3 h pause.
LONG_LINK_S = 120.0
WINDOW_S = 1200.0  # device time the offset's envelope is fitted over
CURVED_SPAN_S = 600.0  # bounds spanning this much are fitted with a curvature (a wandering rate)
BUCKET_S = 4.0  # device time over which only the lowest bound is kept (<= 300 bounds per fit)
REFIT_S = 120.0  # device time between two fits (between them: the tangent, lowered by any bound below it)
MIN_RATE_SPAN_S = 10.0  # no rate is fitted over a shorter span (the previous rate is kept)
MAX_RATE = 1e-3  # |drift| above 1000 ppm is noise in the bounds, not a clock
RATE_HISTORY_S = 86_400.0  # device time over which the fitted rates' spread sets a pause's prior
RATE_PRIOR_MIN_SD = 2e-6  # the least spread of the rate prior after a pause (2 ppm)
MIN_DELAY_S = 1e-5  # the least mean notice delay a prior assumes


@dataclasses.dataclass(frozen=True)
class RatePrior:
    """What the fit before a pause says about the rate after it (`OffsetEstimate.restart`)."""

    before_d: float  # the old fit's newest device time
    before_offset: float  # its offset there
    before_rate: float  # its rate there
    delay_s: float  # mean notice delay above the old fit (its residuals)
    sd: float  # spread of the rate after the pause around the centre (`RATE_PRIOR_MIN_SD` at least)
    link_error_s: float  # half a float32 unit of the pause's link: the device time's error across it


@dataclasses.dataclass(frozen=True)
class OffsetFit:
    """host time − device time around device times [first_d, last_d]: a parabola
    `level + rate·t + curvature·t²` in t = d − last_d, extended along its tangents outside."""

    first_d: float
    last_d: float
    level: float = math.inf  # offset at last_d
    rate: float = 0.0  # its derivative at last_d (the drift, e.g. 5e-5 = 50 ppm)
    curvature: float = 0.0  # half its second derivative (per s)

    def offset_s(self, d: float) -> float:
        t = min(max(d, self.first_d), self.last_d) - self.last_d
        inside = self.level + self.rate * t + self.curvature * t * t
        return inside + (self.rate + 2.0 * self.curvature * t) * (d - self.last_d - t)

    def lowered_to(self, d: float, bound: float) -> OffsetFit:
        """The same fit moved down so that it lies below `bound` at d as well."""
        gap = bound - self.offset_s(d)
        return dataclasses.replace(self, level=self.level + gap) if gap < 0 else self


def _envelope(d: list[float], bound: list[float], *, curved: bool) -> tuple[float, float, float] | None:
    """(level, rate, curvature) of the lower envelope, at the newest d: the line (or parabola)
    below every bound with the highest mean (Moon et al.'s LP); None when the LP finds none."""
    import numpy as np
    from scipy.optimize import linprog

    x, y = np.asarray(d), np.asarray(bound)
    span = float(x[-1] - x[0])
    u = (x - x[-1]) / span  # in [-1, 0]: a well-conditioned LP whatever the units
    floor = float(y.min())
    columns = [np.ones_like(u), u, u * u] if curved else [np.ones_like(u), u]
    a = np.stack(columns, axis=1)
    result = linprog(-a.sum(axis=0), A_ub=a, b_ub=y - floor, bounds=[(None, None)] * len(columns), method="highs")
    if result.status != 0:
        return None
    level, slope, bend = (*result.x, 0.0)[:3]
    rate = slope / span
    if abs(rate) > MAX_RATE:
        return None
    return floor + level, rate, bend / (span * span)


def _anchored_line(d: list[float], bound: list[float], prior: RatePrior) -> tuple[float, float, float]:
    """(level, rate, 0) at the newest d of the young fit after a pause: the rate that maximises
    the bounds' likelihood (exponential delays of mean `prior.delay_s` above the line) times a
    Gaussian prior around the pause's rate (module docstring), the level the line's highest
    below every bound, lowered by the expected least delay of that many bounds."""
    import numpy as np
    from scipy.optimize import minimize_scalar

    x, y = np.asarray(d) - d[-1], np.asarray(bound)
    # The offset's mean rate over the pause, from the lowest bound carried back to the pause's end.
    pause_s = d[0] - prior.before_d
    after_pause = float(np.min(y - prior.before_rate * (x - x[0])))
    mean_rate = (after_pause - prior.before_offset) / pause_s
    mean_sd = (prior.delay_s + prior.link_error_s) / pause_s
    weights = (1.0 / prior.sd ** 2, 1.0 / mean_sd ** 2)
    centre = (weights[0] * prior.before_rate + weights[1] * mean_rate) / sum(weights)
    stiffness = prior.delay_s / (2.0 * prior.sd ** 2)

    def minus_log_posterior(rate: float) -> float:  # in units of the mean delay, constants dropped
        return -(len(x) * float(np.min(y - rate * x)) + rate * float(x.sum()) - stiffness * (rate - centre) ** 2)

    reach = 10.0 * prior.sd + MAX_RATE
    rate = float(minimize_scalar(minus_log_posterior, bounds=(centre - reach, centre + reach), method="bounded",
                                 options={"xatol": 1e-12}).x)
    return float(np.min(y - rate * x)) - prior.delay_s / len(x), rate, 0.0


class OffsetEstimate:
    """host time − device time from notice bounds; thread-safe to read (one immutable fit per
    segment), written under the timeline's lock. An update costs O(1), but every `REFIT_S` of
    device time a fit (a linear program over at most WINDOW_S / BUCKET_S bounds, about 2 ms),
    on whichever thread notices the marker."""

    def __init__(self) -> None:
        self._buckets: collections.deque[list[float]] = collections.deque()  # [index, d, bound]
        self._fit = OffsetFit(first_d=0.0, last_d=0.0)
        self._fitted_at_d = -math.inf
        self._before: tuple[float, OffsetFit] | None = None  # (restart's d, the fit until then)
        self._prior: RatePrior | None = None  # after a pause, until the bounds span CURVED_SPAN_S
        self._rates: collections.deque[tuple[float, float]] = collections.deque()  # (d, fitted rate)

    def add(self, d: float, bound: float) -> None:
        """A marker at device time d was noticed at host time d + bound."""
        index = d // BUCKET_S
        buckets = self._buckets
        if buckets and index <= buckets[-1][0]:
            last = buckets[-1]
            if index == last[0] and bound < last[2]:
                last[1], last[2] = d, bound
        else:
            buckets.append([index, d, bound])
            while buckets[0][1] < d - WINDOW_S:
                buckets.popleft()
        fit = self._fit
        # Refit every REFIT_S, or sooner while the fit spans little (a young fit's tangent is
        # only good for a fraction of its span): extrapolation stays short either way.
        if d - self._fitted_at_d >= min(REFIT_S, 0.1 * (fit.last_d - fit.first_d)) or math.isinf(fit.level):
            self._refit()
            self._fitted_at_d = d
        else:
            self._fit = fit.lowered_to(d, bound)

    def _refit(self) -> None:
        buckets = self._buckets
        d = [bucket[1] for bucket in buckets]
        bound = [bucket[2] for bucket in buckets]
        span = d[-1] - d[0]
        if self._prior is not None and span < CURVED_SPAN_S:
            self._fit = OffsetFit(d[0], d[-1], *_anchored_line(d, bound, self._prior))
            return
        self._prior = None
        found = None
        if len(d) >= 3 and span >= MIN_RATE_SPAN_S:
            found = _envelope(d, bound, curved=span >= CURVED_SPAN_S and len(d) >= 8)
        if found is None:  # too few bounds yet: the last rate, at the level of the lowest bound
            rate = self._fit.rate
            found = (min(b - rate * (x - d[-1]) for x, b in zip(d, bound)), rate, 0.0)
        self._fit = OffsetFit(d[0], d[-1], *found)
        if span >= MIN_RATE_SPAN_S:
            rates = self._rates
            rates.append((d[-1], found[1]))
            while rates[0][0] < d[-1] - RATE_HISTORY_S:
                rates.popleft()

    def restart(self, at_d: float, link_s: float = 0.0) -> None:
        """Forget the bounds from device time `at_d` on (the device clock's coordinate may have
        shifted there by half a float32 unit of the `link_s` across the pause); earlier markers
        keep the fit they had, later ones start from a prior on the rate (module docstring)."""
        fit = self._fit
        self._before = (at_d, fit)
        if self._buckets and math.isfinite(fit.level) and at_d > fit.last_d:
            import numpy as np

            delay_s = max(float(np.mean([b - fit.offset_s(x) for _, x, b in self._buckets])), MIN_DELAY_S)
            spread = float(np.std([rate for _, rate in self._rates])) if len(self._rates) > 1 else 0.0
            link_error_s = float(np.spacing(np.float32(link_s * 1000.0))) / 2000.0
            self._prior = RatePrior(fit.last_d, fit.offset_s(fit.last_d), fit.rate, delay_s,
                                    max(spread, RATE_PRIOR_MIN_SD), link_error_s)
        self._buckets.clear()
        self._fit = dataclasses.replace(fit, level=math.inf)
        self._fitted_at_d = -math.inf

    def offset_s(self, d: float) -> float:
        before = self._before
        if before is not None and d < before[0]:
            return before[1].offset_s(d)
        return self._fit.offset_s(d)

    @property
    def rate(self) -> float:
        """The drift at the newest bound (host seconds per device second, minus one)."""
        return self._fit.rate


class CudaTimeline(DeviceTimeline):
    """Markers are CUDA events on the current stream of the current device."""

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._lock = threading.Lock()
        self.offset = OffsetEstimate()
        reference = cuda.Event(enable_timing=True)
        reference.record()
        # Once, at construction: the first anchor must be complete before elapsed times exist.
        reference.synchronize()
        self._sequence = itertools.count(1)  # record order (the training thread records every marker)
        self._anchor_event = reference
        self._anchor_seq = 0
        self._anchor_d = 0.0
        self._next_anchor: CudaMarker | None = None
        self.anchors = 1  # anchors taken so far (the reference included)
        self.offset.add(0.0, time.perf_counter())

    def record_marker(self) -> DeviceMarker:
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return CudaMarker(self, event, next(self._sequence))

    def anchor_at(self, marker: DeviceMarker) -> None:
        """Measure later markers from `marker` once the device has reached it (an iteration
        start); never blocks."""
        if isinstance(marker, CudaMarker) and marker.timeline is self:
            self._next_anchor = marker

    def synchronize(self) -> None:
        self._cuda.synchronize()

    def _noticed(self, marker: CudaMarker, at_s: float) -> float:
        """A marker noticed reached at `at_s`: its device time d (tightens the offset, and may
        become the anchor)."""
        with self._lock:
            if marker.seq >= self._anchor_seq:
                d = self._anchor_d + self._anchor_event.elapsed_time(marker.event) / 1000.0
            else:  # recorded before the anchor: always ask CUDA for earlier -> later
                d = self._anchor_d - marker.event.elapsed_time(self._anchor_event) / 1000.0
            link_s = d - self._anchor_d
            if marker is self._next_anchor or link_s >= ANCHOR_MAX_AGE_S:
                if marker is self._next_anchor:
                    self._next_anchor = None
                if link_s > 0:
                    self._anchor_event, self._anchor_seq, self._anchor_d = marker.event, marker.seq, d
                    self.anchors += 1
                    if link_s >= LONG_LINK_S:
                        self.offset.restart(d, link_s)
            self.offset.add(d, at_s - d)
        return d

    def device_time_of(self, d: float) -> float:
        return d + self.offset.offset_s(d)


class CudaMarker(DeviceMarker):
    """One CUDA event; its device time is read once it has completed."""

    __slots__ = ("timeline", "event", "seq", "_d")

    def __init__(self, timeline: CudaTimeline, event: Any, seq: int) -> None:
        self.timeline = timeline
        self.event = event
        self.seq = seq
        self._d: float | None = None

    def query(self) -> bool:
        if self._d is None and self.event.query():
            self._d = self.timeline._noticed(self, time.perf_counter())
        return self._d is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._d is not None:
            return True
        if timeout_s is None:
            self.event.synchronize()
            self._d = self.timeline._noticed(self, time.perf_counter())
            return True
        deadline = time.perf_counter() + timeout_s
        while not self.query():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def device_time_s(self) -> float | None:
        if not self.query():
            return None
        return self.timeline.device_time_of(self._d)
