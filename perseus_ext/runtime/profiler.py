"""Online profiling of one stage during real training iterations.

The stage runs whole iterations at one candidate clock (fastest first), records the start and end
of every forward and backward, and reads the GPU energy counter at every computation boundary.
The counter is coarse (it changes every ~100 ms), so single computations cannot be metered.
Instead its updates are located in time -- each lies between the last read showing the old value
and the first showing the new one, and updates come at a steady period, so a line fitted through
them pins every update down to well below one read interval -- and consecutive updates delimit
windows of exactly known energy. Each window holds known amounts of computing time at each clock
(computations cut by a boundary count fractionally) and of blocking time, and the device layer's
least-squares `EnergyEstimator` recovers the power at each clock and the blocking power from many
such windows; a smooth fit of power over the clock pools the clocks against noise. Profiling of
a stage stops early once the `early_stop_patience` clocks below its most efficient clock cost
more energy (lower clocks only get worse from there), which keeps profiling to a handful of
iterations.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

import numpy as np

from perseus_ext.measurement.windows import EnergyEstimator, MeasurementError, WindowRecord
from perseus_ext.planning.schedule import Kind

logger = logging.getLogger(__name__)

SMOOTH_MIN_CLOCKS = 4  # from this many profiled clocks on, power is fitted as a function of clock
OVERHEAD_PERCENTILE = 20  # of the gaps between computations: framework work without waiting


@dataclass(frozen=True)
class ProfileRow:
    """One measured (stage, instruction, clock); field names are the profile CSV's columns."""

    stage: int
    instruction: str
    frequency: int
    time: float  # seconds
    energy: float  # joules


@dataclass(frozen=True)
class StageMeasurements:
    """One rank's profile rows plus its GPU's blocking power, as exchanged between ranks."""

    stage: int
    rows: tuple[ProfileRow, ...]
    blocking_power_w: float  # this GPU's power while blocked
    overhead_s: float = 0.0  # framework time per computation, included in the rows' times
    clocks_mhz: tuple[int, ...] = field(default=())  # the clocks the rows cover


def locate_updates(changes: list[tuple[float, float]]) -> list[float]:
    """Times of counter updates, each known to lie in (after, at] of `changes`.

    The counter updates on a steady period, so the interval midpoints are fitted with
    t_k = phase + n_k * period (n_k = the update's ordinal); each fitted time is then clipped
    into its interval, which also keeps an irregular counter within the read resolution.
    """
    mids = np.array([(a + b) / 2 for a, b in changes])
    if len(mids) < 3:
        return mids.tolist()
    period = float(np.median(np.diff(mids)))
    if period <= 0:
        return mids.tolist()
    # Count updates step by step (a gap of ~2 periods means a missed update), so a small error
    # in the first period estimate cannot accumulate over a long run.
    steps = np.maximum(1.0, np.round(np.diff(mids) / period))
    ordinals = np.concatenate([[0.0], np.cumsum(steps)])
    slope, phase = np.polyfit(ordinals, mids, 1)
    fitted = phase + ordinals * slope
    low = np.array([a for a, _ in changes])
    high = np.array([b for _, b in changes])
    return np.clip(fitted, low, high).tolist()


def build_windows(
    reads: list[tuple[float, int | None]], computations: list[tuple[str, float, float]]
) -> list[WindowRecord]:
    """Windows between consecutive counter updates, with the computations they contain.

    A computation cut by a window boundary counts fractionally (by time) on both sides; a
    failed read (None) ends the current run of windows.
    """
    runs: list[list[tuple[float, float, int]]] = [[]]  # per run: (after, at, value) of each change
    previous: tuple[float, int] | None = None
    for timestamp, value in reads:
        if value is None:
            previous = None
            runs.append([])
            continue
        if previous is not None and value != previous[1]:
            runs[-1].append((previous[0], timestamp, value))
        previous = (timestamp, value)
    starts = np.array([start for _, start, _ in computations])
    ends = np.array([end for _, _, end in computations])
    labels = [label for label, _, _ in computations]
    records = []
    for changes in runs:
        if len(changes) < 2:
            continue
        times = locate_updates([(a, b) for a, b, _ in changes])
        for (begin, first), (end, second) in zip(zip(times, changes), zip(times[1:], changes[1:])):
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


class StageProfiler:
    """Candidate-clock schedule, raw measurements and early stop for one stage."""

    def __init__(
        self,
        stage: int,
        clocks: list[int],
        *,
        iterations_per_clock: int,
        early_stop: bool,
        patience: int,
        blocking_power_w: float | None = None,
    ) -> None:
        if not clocks:
            raise ValueError("profiling needs at least one candidate clock")
        self.stage = stage
        self.clocks = list(clocks)
        self.iterations_per_clock = iterations_per_clock
        self.early_stop = early_stop
        self.patience = patience
        self.blocking_power_w = blocking_power_w
        self.iterations = 0  # profiling iterations this stage has run at a candidate clock
        self.done = False
        self.stop_reason = ""
        self.durations: dict[tuple[str, int], list[float]] = {}
        self.reads: list[tuple[float, int | None]] = []
        self.computations: list[tuple[int, float, float]] = []  # (clock, start, end)
        self.block_energy: dict[int, float] = {}  # clock -> estimated J of one forward+backward
        self.gaps: list[float] = []  # time between consecutive computations of an iteration
        self._last_end: float | None = None

    # ------------------------------------------------------------------ schedule
    @property
    def current_clock(self) -> int | None:
        """The clock this stage profiles in its next iteration, None once done."""
        if self.done:
            return None
        return self.clocks[self.iterations // self.iterations_per_clock]

    @property
    def profiled_clocks(self) -> list[int]:
        return [c for c in self.clocks if (Kind.FORWARD.value, c) in self.durations]

    # ------------------------------------------------------------------ recording
    def on_counter(self, timestamp: float, energy_mj: int | None) -> None:
        """A counter read at a computation boundary (None: the read failed)."""
        if not self.done:
            self.reads.append((timestamp, energy_mj))

    def on_computation(self, kind: str, clock: int, start: float, end: float) -> None:
        """A finished computation, timed on the device's clock."""
        if self.done:
            return
        self.durations.setdefault((kind, clock), []).append(end - start)
        self.computations.append((clock, start, end))
        if self._last_end is not None:
            self.gaps.append(start - self._last_end)
        self._last_end = end

    def end_iteration(self) -> None:
        """Advance the clock schedule; decide the early stop after each clock's block."""
        if self.done:
            return
        self._last_end = None  # the gap across iterations holds the optimizer step
        self.iterations += 1
        if self.iterations % self.iterations_per_clock:
            return
        clock = self.clocks[self.iterations // self.iterations_per_clock - 1]
        self._judge(clock)
        if not self.done and self.iterations // self.iterations_per_clock >= len(self.clocks):
            self._finish(f"all {len(self.clocks)} candidate clocks profiled")

    def _judge(self, clock: int) -> None:
        """Stop once the best clock so far (re-estimated from all windows) lies `patience`
        profiled clocks above the current one."""
        try:
            energies = self._power_model_energies()
        except MeasurementError as err:
            logger.debug("stage %d: no energy estimate yet after %d MHz (%s)", self.stage, clock, err)
            return
        self.block_energy = energies
        profiled = [c for c in self.profiled_clocks if c in energies]
        if not self.early_stop or not profiled:
            return
        best = min(profiled, key=energies.get)
        beyond = len(profiled) - 1 - profiled.index(best)
        if beyond >= self.patience:
            self._finish(f"early stop at {clock} MHz: the {beyond} clock(s) below {best} MHz "
                         f"cost more energy")

    def _finish(self, reason: str) -> None:
        self.done = True
        self.stop_reason = reason
        logger.info("perseus-ext: stage %d profiling done after %d iteration(s): %s",
                    self.stage, self.iterations, reason)

    def stop(self, reason: str) -> None:
        """End profiling from outside (e.g. the job-wide profiling budget ran out)."""
        if not self.done:
            self._finish(reason)

    # ------------------------------------------------------------------ estimation
    def _median_time(self, kind: str, clock: int) -> float:
        return statistics.median(self.durations[kind, clock])

    def _power_model_energies(self) -> dict[int, float]:
        """J of one forward + one backward per clock, assuming both draw the same power at a
        clock (well conditioned: one unknown per clock); used for the early stop."""
        powers, _ = self._power_model()
        return {
            clock: power * (self._median_time("forward", clock) + self._median_time("backward", clock))
            for clock, power in powers.items()
            if ("forward", clock) in self.durations and ("backward", clock) in self.durations
        }

    @property
    def windows(self) -> list[WindowRecord]:
        return build_windows(self.reads, self.computations)

    def _power_model(self) -> tuple[dict[int, float], float]:
        """Watts per clock and blocking watts.

        Each window's "count" of clock f is the seconds it spent computing at f, so the
        estimator's energy per count is the power at f. With `SMOOTH_MIN_CLOCKS` or more clocks
        the per-clock powers are replaced by a weighted quadratic fit over the clock: power is a
        smooth function of the clock, and the fit pools every clock's windows against noise
        (one iteration per clock leaves each clock only a couple of windows).
        """
        seconds_per_clock = [
            WindowRecord(dict(record.busy_s), record.duration_s, record.energy_j, dict(record.busy_s))
            for record in self.windows
        ]
        estimator = EnergyEstimator(self.blocking_power_w)
        estimator.extend(seconds_per_clock)
        estimate = estimator.estimate()
        powers = {int(clock): est.energy_j for clock, est in estimate.labels.items()}
        if len(powers) >= SMOOTH_MIN_CLOCKS:
            clocks = np.array(sorted(powers), dtype=float)
            errors = np.array([estimate.labels[int(c)].stderr_j for c in clocks])
            weights = 1.0 / np.maximum(errors, 1e-3 * np.mean([powers[int(c)] for c in clocks]))
            scale = clocks.max()
            coefficients = np.polyfit(clocks / scale, [powers[int(c)] for c in clocks], 2, w=weights)
            powers = {int(c): float(np.polyval(coefficients, c / scale)) for c in clocks}
        return powers, estimate.idle_power_w

    def measurements(self, only: list[int] | None = None) -> StageMeasurements:
        """The stage's profile rows (restricted to clocks `only`, if given).

        A computation's energy is the fitted power at its clock times its median duration.
        Forward and backward share the power of their clock: within an iteration they always
        come in equal numbers, so windows separate them only with many more profiling
        iterations, and GPUs draw nearly the same power for both (the published A100 profiles
        differ by ~1%).
        """
        clocks = [c for c in self.profiled_clocks if ("backward", c) in self.durations
                  and (only is None or c in only)]
        if not clocks:
            raise MeasurementError(f"stage {self.stage}: no computation was profiled")
        powers, blocking = self._power_model()
        energies = {
            (kind, clock): powers[clock] * self._median_time(kind, clock)
            for clock in clocks if clock in powers
            for kind in ("forward", "backward")
        }
        blocking = max(blocking, 0.0)
        overhead = self.overhead_s
        rows = tuple(
            ProfileRow(self.stage, kind, clock, self._median_time(kind, clock) + overhead,
                       max(energy, 1e-9) + overhead * blocking)
            for (kind, clock), energy in sorted(energies.items())
        )
        return StageMeasurements(self.stage, rows, blocking, overhead, tuple(sorted({r.frequency for r in rows})))

    @property
    def overhead_s(self) -> float:
        """The framework's own time between two computations when nothing is waited for.

        Gaps between consecutive computations are framework work (sending, receiving, loading)
        plus waits for other stages; the low end of their distribution is the work alone. The
        planner's model has no such term, so it is added to every computation's time (and its
        blocking energy to its energy): plans then never spend slack the framework needs.
        """
        if not self.gaps:
            return 0.0
        return max(float(np.percentile(self.gaps, OVERHEAD_PERCENTILE)), 0.0)
