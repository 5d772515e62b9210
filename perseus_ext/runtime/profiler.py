"""Online profiling of one stage during real training iterations.

The stage runs whole iterations at one candidate clock (fastest first), records the start and end
of every computation (forward and backward, or on split-backward schedules also the input- and
weight-gradient computations; one profile row per kind the stage ran), and reads the GPU energy counter at every computation boundary.
The counter is coarse (it changes every ~100 ms), so single computations cannot be metered.
Instead its updates are located in time from the reads at computation boundaries, and
consecutive updates delimit windows of exactly known energy (`measurement/counter_updates.py`).
Each window holds known amounts of computing time at each clock and of blocking time, and the
device layer's least-squares `EnergyEstimator` recovers the power at each clock, with its
standard error, and the blocking power from many such windows, leaving out the few windows a
stale read has garbled. A clock whose energy stays uncertain is left out of the profile. While
the windows cannot yet separate the clocks, the search goes round them once more
(`MAX_PROFILING_ROUNDS`).

The search walks the whole clock range downwards in coarse steps (about 1/16 of the maximum clock,
e.g. 90 MHz on an A100; the frontier's fastest plan gains nothing from finer steps) and stops only
once it is *confident*: the last `early_stop_patience` clocks each cost more energy than the most
efficient one by more than twice their combined standard error, so counter noise can neither
stop it near the maximum clock nor name the maximum clock most efficient. It also keeps going
through the clocks that are useful once a wait is paid -- below the minimum-energy clock, a
computation that waits anyway costs energy minus blocking power x time, which is lowest at a
lower clock -- so the planner's wait-aware frontier finds them in the profile.

Framework overhead, the time between two computations that the planner's model must add to
each, is what a *deployed* iteration pays there, not what a profiling one does. Profiling
synchronises around every computation, so its gaps hold the host's whole turn (Python,
launches, the data loader, any sleep), which a deployed iteration, launching ahead of the
device, hides behind the computations still queued. Each profiling gap is therefore split on
the device timeline: its *host part*, from the previous computation's end until the host reached
the next one, and its *device part*, from then until the device started it (device work the
host queued in the gap, or, where the input comes from another stage, the pipeline wait, which
the planner models itself and is never counted). Only gaps before computations whose input is
local (the data loader, the last stage's own forward) are used when the schedule has any. What
a deployed iteration pays is read off the device's own markers in an unsynchronised iteration
(the last warm-up one, `on_free_running_iteration`): the device gap before each such
computation, which holds the device part in full (communication kernels, copies, waits on
other ranks' events, queued behind the previous computation) and the host part only where the
host fell behind the device. Counting the host part as hidden by the previous computation
instead would miss device work that overlapped the host's turn while profiling, and plans
would come out too tight. Without an unsynchronised iteration the whole profiling gap counts.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.interpolate import UnivariateSpline

from perseus_ext.measurement.counter_updates import build_windows
from perseus_ext.measurement.windows import EnergyEstimator, MeasurementError, WindowRecord
from perseus_ext.planning.schedule import Kind

# The kinds a stage's rows are measured for, in the order they are summed (`_block_time`); a
# combined unit (megatron-core's combined_1f1b step) is timed as one computation of its own, and
# so is a gradient sync where the schedule runs it as an action (torch.distributed.pipelining's
# REDUCE_GRAD: the FSDP post-backward and the gradient scaling), so it is planned like the rest.
TIMED_KINDS = (Kind.FORWARD.value, Kind.BACKWARD.value, Kind.INPUT_GRADIENT.value, Kind.WEIGHT_GRADIENT.value,
               Kind.COMBINED.value, Kind.REDUCE_GRAD.value)

logger = logging.getLogger(__name__)

SMOOTH_MIN_CLOCKS = 4  # from this many profiled clocks on, power is smoothed over the clock
OVERHEAD_PERCENTILE = 20  # of the gaps between computations: framework work without waiting
COARSE_STEPS_PER_MAX_CLOCK = 16  # coarse search step = max clock / 16 (90 MHz on an A100)
CONFIDENCE_Z = 2.0  # "costs more" = more than this many combined standard errors more
MIN_RESIDUAL_DOF = 3  # windows beyond the unknowns before a standard error is trusted
OUTLIER_MADS = 6.0  # windows this far off the fit (stale counter reads) are left out of it
MAX_RELATIVE_STDERR = 0.03  # a clock whose energy is less certain than this stays out of the profile
MAX_PROFILING_ROUNDS = 2  # rounds over the search clocks while the counter's windows cannot separate them


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
    overhead_measured: bool = True  # False: no gap free of pipeline waits; rows hold no overhead


def coarse_stride(clocks: Sequence[int]) -> int:
    """Candidate-list entries per coarse search step (about max clock / 16)."""
    if len(clocks) < 2:
        return 1
    spacing = (max(clocks) - min(clocks)) / (len(clocks) - 1)
    return max(1, round(max(clocks) / COARSE_STEPS_PER_MAX_CLOCK / spacing))


@dataclass(frozen=True)
class ClockEstimate:
    """Per-clock figures of one computation of each kind the stage runs (one forward + one
    backward on 1F1B): the basis of the stop decision."""

    clock: int
    energy_j: float
    energy_stderr_j: float
    wait_cost_j: float  # energy - blocking power x time: the cost when the stage waits anyway


class StageProfiler:
    """Candidate-clock search, raw measurements and confident early stop for one stage."""

    def __init__(
        self,
        stage: int,
        clocks: list[int],
        *,
        iterations_per_clock: int,
        early_stop: bool,
        patience: int,
        blocking_power_w: float | None = None,
        keep_wait_useful: bool = True,
        local_inputs: Sequence[bool] | None = None,
    ) -> None:
        """clocks: the candidates, fastest first; they are searched in coarse steps.
        keep_wait_useful: do not stop before the clocks that are useful once a wait is paid.
        local_inputs: per position of the stage's iteration order, whether that computation's
        input is local (no pipeline wait can precede it); None: unknown."""
        if not clocks:
            raise ValueError("profiling needs at least one candidate clock")
        self.stage = stage
        self.clocks = list(clocks)
        self.search_clocks = self.clocks[:: coarse_stride(self.clocks)]
        self.iterations_per_clock = iterations_per_clock
        self.early_stop = early_stop
        self.patience = patience
        self.blocking_power_w = blocking_power_w
        self.keep_wait_useful = keep_wait_useful
        self.local_inputs = list(local_inputs) if local_inputs is not None else None
        self.iterations = 0  # profiling iterations this stage has run at a candidate clock
        self.energy_stop_iterations: int | None = None  # when an energy-only stop would have come
        self.done = False
        self.stop_reason = ""
        self.durations: dict[tuple[str, int], list[float]] = {}
        self.reads: list[tuple[float, int | None]] = []
        self.computations: list[tuple[int, float, float]] = []  # (clock, start, end)
        self.block_energy: dict[int, float] = {}  # clock -> estimated J of one computation of each kind
        self.gaps: list[float] = []  # host parts of the gaps between consecutive computations
        self.local_gaps: list[float] = []  # those before a computation whose input is local
        self.waits_s: list[float] = []  # device parts: input waits (never overhead) or device work
        self.local_device_s: list[float] = []  # device parts before a local input: device work
        self.free_running_gaps: list[float] = []  # device gaps of unsynchronised iterations, local inputs
        self._windows: tuple[tuple[int, ...], list[WindowRecord]] | None = None  # (data key, windows)
        self._last_end: float | None = None
        self._position = 0  # of the next computation in the iteration

    # ------------------------------------------------------------------ schedule
    @property
    def current_clock(self) -> int | None:
        """The clock this stage profiles in its next iteration, None once done."""
        if self.done:
            return None
        return self._search_clock(self.iterations // self.iterations_per_clock)

    def _search_clock(self, block: int) -> int:
        """The clock of the `block`-th block of iterations: the search clocks in turn, round
        after round while the windows cannot yet separate them (`end_iteration`)."""
        return self.search_clocks[block % len(self.search_clocks)]

    @property
    def profiled_clocks(self) -> list[int]:
        return [c for c in self.clocks if (Kind.FORWARD.value, c) in self.durations]

    # ------------------------------------------------------------------ recording
    def on_counter(self, timestamp: float, energy_mj: int | None) -> None:
        """A counter read at a computation boundary (None: the read failed)."""
        if not self.done:
            self.reads.append((timestamp, energy_mj))

    def on_computation(self, kind: str, clock: int, start: float, end: float, *,
                       ready: float | None = None) -> None:
        """A finished computation, timed on the device's clock. `ready`: when the host reached
        it, before waiting for its input; the wait from there to `start` is not overhead."""
        if self.done:
            return
        self.durations.setdefault((kind, clock), []).append(end - start)
        self.computations.append((clock, start, end))
        reached = start if ready is None else min(max(ready, self._last_end or ready), start)
        if self._last_end is not None:
            self.gaps.append(reached - self._last_end)
            self.waits_s.append(start - reached)
            if self._local_input(self._position):
                self.local_gaps.append(reached - self._last_end)
                self.local_device_s.append(start - reached)
        self._last_end = end
        self._position += 1

    def _local_input(self, position: int) -> bool:
        return self.local_inputs is not None and position < len(self.local_inputs) and self.local_inputs[position]

    def on_free_running_iteration(self, start_s: float, spans: Sequence[tuple[float, float]]) -> None:
        """The device's iteration start and (start, end) of each computation of one iteration
        run without synchronising (in the stage's order): the gaps before local inputs, the
        first one's from the iteration start included, are what a deployed iteration pays
        before its computations (`overhead_s`). Every gap counts when the inputs are unknown."""
        ends = [start_s] + [end for _, end in spans[:-1]]
        for position, ((begin, _), previous_end) in enumerate(zip(spans, ends)):
            if self.local_inputs is None or self._local_input(position):
                self.free_running_gaps.append(max(begin - previous_end, 0.0))

    def end_iteration(self) -> None:
        """Advance the clock search; decide the early stop after each clock's block."""
        if self.done:
            return
        self._last_end = None  # the gap across iterations holds the optimizer step
        self._position = 0
        self.iterations += 1
        if self.iterations % self.iterations_per_clock:
            return
        block = self.iterations // self.iterations_per_clock
        self._judge(self._search_clock(block - 1))
        if self.done or block % len(self.search_clocks):
            return
        rounds = block // len(self.search_clocks)
        searched = (f"all {len(self.search_clocks)} search clocks profiled "
                    f"({self.search_clocks[0]}-{self.search_clocks[-1]} MHz)")
        unresolved = self._unresolved()
        if unresolved is None:
            self._finish(searched + (f" in {rounds} rounds" if rounds > 1 else ""))
        elif rounds >= MAX_PROFILING_ROUNDS:
            self._finish(f"{searched} in {rounds} rounds; the energy counter still cannot tell them "
                         f"apart ({unresolved})")
        else:
            # Short iterations next to the counter's update period (NVML: ~100 ms), or windows
            # left out as outliers on a busy host: one more round adds windows at every clock.
            logger.info("perseus-ext: stage %d: after %d round(s) over the search clocks: %s; profiling "
                        "them once more", self.stage, rounds, unresolved)

    def _unresolved(self) -> str | None:
        """Why the windows cannot yet give every profiled clock a power, None when they can."""
        try:
            powers, _, _ = self._raw_power()
        except MeasurementError as err:
            return str(err)
        missing = [clock for clock in self.profiled_clocks if clock not in powers]
        return f"no window measured {missing} MHz" if missing else None

    def _judge(self, clock: int) -> None:
        """Stop once each of the last `patience` profiled clocks lies below the most efficient
        one and confidently costs more -- with `keep_wait_useful`, also more than the most
        efficient clock once a wait is paid (so none of them is useful to the planner)."""
        try:
            estimates = self.clock_estimates()
            self.block_energy = self._power_model_energies()
        except MeasurementError as err:
            logger.debug("stage %d: no energy estimate yet after %d MHz (%s)", self.stage, clock, err)
            return
        if not self.early_stop or len(estimates) <= self.patience:
            return
        best = min(range(len(estimates)), key=lambda i: estimates[i].energy_j)
        tail = estimates[-self.patience:]
        if best >= len(estimates) - self.patience:
            return
        anchor = estimates[best]

        def confidently_above(value: float, reference: float, stderr: float) -> bool:
            margin = CONFIDENCE_Z * math.hypot(stderr, anchor.energy_stderr_j)
            return math.isfinite(margin) and value - reference > margin

        if not all(confidently_above(e.energy_j, anchor.energy_j, e.energy_stderr_j) for e in tail):
            return
        if self.energy_stop_iterations is None:
            self.energy_stop_iterations = self.iterations
        if self.keep_wait_useful and not all(
                confidently_above(e.wait_cost_j, anchor.wait_cost_j, e.energy_stderr_j) for e in tail):
            return
        why = (f"the {self.patience} clock(s) below {anchor.clock} MHz confidently cost more energy"
               + (", also once a wait is paid" if self.keep_wait_useful else ""))
        if clock == self.search_clocks[-1]:  # nothing was left to skip: not an early stop
            self._finish(f"all {len(self.search_clocks)} search clocks profiled ({self.search_clocks[0]}-{clock} MHz); {why}")
        else:
            self._finish(f"early stop at {clock} MHz, {len(self.search_clocks) - 1 - self.search_clocks.index(clock)} "
                         f"lower search clock(s) skipped: {why}")

    def _finish(self, reason: str) -> None:
        self.done = True
        if self.keep_wait_useful and self.energy_stop_iterations is not None \
                and self.energy_stop_iterations < self.iterations:
            reason += (f" ({self.iterations - self.energy_stop_iterations} iteration(s) kept clocks useful once a "
                       f"wait is paid)")
        self.stop_reason = reason
        # DEBUG: the runtime says it once per stage when every stage is done ("profiling finished")
        logger.debug("perseus-ext: stage %d profiling done after %d iteration(s): %s",
                     self.stage, self.iterations, reason)

    def stop(self, reason: str) -> None:
        """End profiling from outside (e.g. the job-wide profiling budget ran out)."""
        if not self.done:
            self._finish(reason)

    # ------------------------------------------------------------------ estimation
    def _median_time(self, kind: str, clock: int) -> float:
        return statistics.median(self.durations[kind, clock])

    @property
    def timed_kinds(self) -> list[str]:
        """The computation kinds this stage ran while profiling, in `TIMED_KINDS` order (forward
        and backward on 1F1B; forward, input and weight gradient on a zero-bubble schedule)."""
        seen = {kind for kind, _ in self.durations}
        unknown = sorted(seen - set(TIMED_KINDS))
        if unknown:
            raise MeasurementError(f"stage {self.stage}: the profiler times {', '.join(TIMED_KINDS)} "
                                   f"computations, not {', '.join(unknown)}")
        return [kind for kind in TIMED_KINDS if kind in seen]

    def _block_time(self, clock: int) -> float | None:
        """Seconds of one computation of each timed kind at `clock` (one forward + one backward
        on 1F1B), None if a kind is missing there."""
        kinds = self.timed_kinds
        if not kinds or any((kind, clock) not in self.durations for kind in kinds):
            return None
        return sum(self._median_time(kind, clock) for kind in kinds)

    @property
    def windows(self) -> list[WindowRecord]:
        """Built once per new data: locating the updates takes a few hundred ms of the training
        thread on a long run, and every stop decision and profile asks again."""
        key = (len(self.reads), len(self.computations), id(self.reads), id(self.computations))
        if self._windows is None or self._windows[0] != key:
            self._windows = (key, build_windows(self.reads, self.computations))
        return self._windows[1]

    def _raw_power(self) -> tuple[dict[int, tuple[float, float]], float, int]:
        """(watts, standard error) per clock, blocking watts, and the residual degrees of
        freedom. Each window's "count" of clock f is the seconds it spent computing at f, so
        the estimator's energy per count is the power at f."""
        seconds_per_clock = [
            WindowRecord(dict(record.busy_s), record.duration_s, record.energy_j, dict(record.busy_s))
            for record in self.windows
        ]
        estimator = EnergyEstimator(self.blocking_power_w, outlier_mads=OUTLIER_MADS)
        estimator.extend(seconds_per_clock)
        estimate = estimator.estimate()
        powers = {int(clock): (est.energy_j, est.stderr_j) for clock, est in estimate.labels.items()}
        unknowns = len(powers) + (self.blocking_power_w is None)
        return powers, estimate.idle_power_w, estimate.windows - unknowns

    def clock_estimates(self) -> list[ClockEstimate]:
        """Raw (unsmoothed) figures per profiled clock, fastest first; standard errors are
        infinite until the windows leave `MIN_RESIDUAL_DOF` degrees of freedom."""
        powers, blocking_w, dof = self._raw_power()
        result = []
        for clock in self.profiled_clocks:
            seconds = self._block_time(clock)
            if clock not in powers or seconds is None:
                continue
            power, stderr = powers[clock]
            stderr = stderr if dof >= MIN_RESIDUAL_DOF and math.isfinite(stderr) else math.inf
            result.append(ClockEstimate(clock, power * seconds, stderr * seconds,
                                        (power - max(blocking_w, 0.0)) * seconds))
        return result

    def untrusted_clocks(self) -> set[int]:
        """Profiled clocks whose energy the windows pin down no better than `MAX_RELATIVE_STDERR`.

        Neighbouring profiled clocks differ by a few percent in energy near the minimum-energy
        clock, so a clock known only to +-5% may look cheaper than it is and pull plans to it.
        The fastest profiled clock is always kept (it is the default the planner falls back on);
        without residual degrees of freedom no clock can be judged, and all are kept.
        """
        try:
            estimates = self.clock_estimates()
        except MeasurementError:
            return set()
        if not estimates or not all(math.isfinite(e.energy_stderr_j) for e in estimates):
            return set()
        fastest = max(e.clock for e in estimates)
        untrusted = {e.clock for e in estimates
                     if e.clock != fastest and e.energy_stderr_j > MAX_RELATIVE_STDERR * abs(e.energy_j)}
        if len(untrusted) == len(estimates) - 1 > 0:
            # Every clock equally uncertain (computations short next to the counter's steps):
            # dropping them all would leave nothing to plan with; the estimates stay, flagged.
            logger.warning("perseus-ext: stage %d: every profiled clock's energy is uncertain by more "
                           "than %.0f%%; planning on the estimates as they are", self.stage,
                           100 * MAX_RELATIVE_STDERR)
            return set()
        return untrusted

    def _power_model_energies(self) -> dict[int, float]:
        """J of one computation of each timed kind per clock from the smoothed power model."""
        powers, _ = self._power_model()
        return {clock: power * seconds for clock, power in powers.items()
                if (seconds := self._block_time(clock)) is not None}

    def _power_model(self) -> tuple[dict[int, float], float]:
        """Watts per clock (smoothed) and blocking watts.

        With `SMOOTH_MIN_CLOCKS` or more clocks the per-clock powers are replaced by a smoothing
        spline over the clock, weighted by their standard errors: power is a smooth function of
        the clock, and the spline pools neighbouring clocks against noise (one iteration per
        clock leaves each clock only a couple of windows) while following the curve's knee,
        which one global polynomial over the whole searched range cannot.
        """
        raw, blocking_w, _ = self._raw_power()
        powers = {clock: power for clock, (power, _) in raw.items()}
        if len(powers) < SMOOTH_MIN_CLOCKS:
            return powers, blocking_w
        clocks = np.array(sorted(powers), dtype=float)
        values = np.array([powers[int(c)] for c in clocks])
        errors = np.array([raw[int(c)][1] for c in clocks])
        floor = 1e-3 * float(np.mean(np.abs(values)))
        usable = np.isfinite(errors) & (errors > 0)
        if not usable.all():
            errors = np.full_like(values, max(floor, float(np.std(values)) * 0.05))
        spline = UnivariateSpline(clocks, values, w=1.0 / np.maximum(errors, floor),
                                  k=min(3, len(clocks) - 1), s=len(clocks))
        return {int(c): float(v) for c, v in zip(clocks, spline(clocks))}, blocking_w

    def measurements(self, only: list[int] | None = None) -> StageMeasurements:
        """The stage's profile rows (restricted to clocks `only`, if given).

        One row per timed kind (`timed_kinds`) and clock where every timed kind ran. A
        computation's energy is the smoothed power at its clock times its median duration.
        All kinds share the power of their clock: within an iteration they come in fixed
        proportions, so windows separate them only with many more profiling iterations, and
        GPUs draw nearly the same power for each (the published A100 profiles' forward and
        backward differ by ~1%). Profiled clocks below the minimum-energy clock are kept (the planner
        decides which are useful), but not the clocks whose estimate is not confident
        (`untrusted_clocks`).
        """
        kinds = self.timed_kinds
        clocks = [c for c in self.profiled_clocks if all((kind, c) in self.durations for kind in kinds)
                  and (only is None or c in only)]
        if not clocks:
            raise MeasurementError(f"stage {self.stage}: no computation was profiled")
        untrusted = self.untrusted_clocks()
        if untrusted:
            logger.info("perseus-ext: stage %d: profile leaves out %s MHz: energy standard error above %.0f%%",
                        self.stage, sorted(untrusted, reverse=True), 100 * MAX_RELATIVE_STDERR)
            clocks = [c for c in clocks if c not in untrusted]
        powers, blocking = self._power_model()
        energies = {
            (kind, clock): powers[clock] * self._median_time(kind, clock)
            for clock in clocks if clock in powers
            for kind in kinds
        }
        blocking = max(blocking, 0.0)
        overhead = self.overhead_s or 0.0
        rows = tuple(
            ProfileRow(self.stage, kind, clock, self._median_time(kind, clock) + overhead,
                       max(energy, 1e-9) + overhead * blocking)
            for (kind, clock), energy in sorted(energies.items())
        )
        return StageMeasurements(self.stage, rows, blocking, overhead,
                                 tuple(sorted({r.frequency for r in rows})), self.overhead_s is not None)

    @property
    def overhead_s(self) -> float | None:
        """The time a deployed iteration spends between two computations when nothing is waited
        for; None when every gap may hold a pipeline wait (the pipeline leader fills it in).

        The planner's model has no such term, so it is added to every computation's time (and
        its blocking energy to its energy): plans then never spend slack the framework needs.
        With an unsynchronised iteration's device gaps, it is their median (no pipeline wait
        precedes a local input, so each is what an iteration pays there, the one before the
        first computation included), never less than the low end (`OVERHEAD_PERCENTILE`) of
        the profiling gaps' device parts (device work, which runs whoever launches it).
        Without, the low end of the profiling gaps, host and device parts together (the low end
        leaves out host-side waits of a host-side transport; the module docstring says why the
        host part is not simply taken as hidden).
        """
        if self.local_inputs is None:  # device parts may be pipeline waits: host parts only
            gaps = self.gaps
            device = [0.0] * len(gaps)
        else:
            gaps, device = self.local_gaps, self.local_device_s
        if not gaps:
            return None if self.gaps else 0.0
        device_part = float(np.percentile(device, OVERHEAD_PERCENTILE))
        if self.free_running_gaps:
            paid = float(np.median(self.free_running_gaps))
            return max(paid, device_part, 0.0)
        whole = [host + dev for host, dev in zip(gaps, device)]
        return max(float(np.percentile(whole, OVERHEAD_PERCENTILE)), 0.0)
