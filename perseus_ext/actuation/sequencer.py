"""Planned clocks in force while the device runs the computations they were planned for.

The training thread only *launches* work; the GPU runs it later. So a clock change is tied to a
device marker (a CUDA event) recorded at the computation boundary, and the controller's worker
applies it when the device reaches that marker:

* iteration start marker  -> the first computation's clock (the device has finished the previous
  iteration's optimizer step, which ran at the default clock); once the gap between iterations
  (gradient sync, optimizer step) has been measured, issued ahead instead, the switching latency
  plus the ramp before the next iteration is due to start -- in a gap shorter than the switching
  latency the change lands in the first computation (no change could land inside the gap); and
  never later than the device reaching the iteration start marker, whatever the last gap was;
* end of computation k    -> computation k+1's clock, so the switch happens while the stage waits
  for its next input (for a receive-bound stage that is the start of the communication gap);
  with a communication clock, that clock instead, and k+1's clock at k+1's start marker;
* when the plan's durations are known, a change is issued ahead so that its ramp starts when
  computation k ends -- or, if the stage then waits for its next input, ends when computation
  k+1 starts: the whole ramp falls into the wait when the wait is long enough (the planner
  charges the ramp from computation k's end, `planning/energy.py`). It is tied to the
  end of an earlier computation j plus the planned time in between: the device's own timeline
  of the latest iteration it completed with the same clocks, else the planned durations plus the
  waits the device showed then (a pipeline stage's receive waits are idle device time that
  host-side durations do not show);
* end of the last computation -> the default clocks: the gradient all-reduce, the optimizer step,
  evaluation and checkpointing run on every stage's critical path, so they get the default clock
  -- unless the gap between iterations is shorter than the switching latency plus the ramp: a
  reset could then only land in the next iteration's first computation, so the last clock stays
  until the next one's first clock is in force.

Recording a marker costs microseconds and never synchronises; the markers are also kept per
computation so the clock coverage can be estimated from device timestamps.

An iteration run at a plan slowed for a straggler also queues that straggler episode's recovery
program (`RecoveryProgram`): at the iteration start and at every computation's end, the fastest
plan's clock of the next computation -- or of the one after it, when that is higher, so that a
raise is in force before the computation it serves starts, as a change tied to an end marker
lands a switching latency late. The controller applies it instead of the slowed plan's changes
once the episode is overridden (the straggler recovered, `FrequencyController.recover`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from perseus_ext.actuation.clock_control import ClockControl
from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline, SwitchLatency

TIMELINES_KEPT = 4  # clock plans whose last device timeline is remembered


@dataclass(frozen=True)
class RecoveryProgram:
    """What an iteration run at a plan slowed for straggler `episode` runs once the episode is
    overridden: `clocks`, the fastest plan's clock of each computation of the stage."""

    episode: int
    clocks: tuple[int, ...]

    def clock_from(self, position: int) -> int:
        """The clock to set as computation `position` is next: the higher of its own and the
        next one's (a raise lands before the computation it serves)."""
        return max(self.clocks[position:position + 2])


@dataclass
class IterationTrace:
    """One iteration's computation markers: (start, end, planned clock) per computation."""

    iteration: int
    spans: list[tuple[DeviceMarker, DeviceMarker | None, int | None]] = field(default_factory=list)
    start: DeviceMarker | None = None  # the iteration start marker

    def device_offsets(self) -> list[tuple[float, float]] | None:
        """(start, end) of each computation on the device, seconds after the iteration start
        marker; None until the device has reached every marker. Never blocks."""
        start_s = self.start.device_time_s() if self.start is not None else None
        spans = self.device_spans() if start_s is not None else None
        if not spans:
            return None
        return [(begin - start_s, end - start_s) for begin, end, _ in spans]

    @property
    def planned_clocks(self) -> tuple[int | None, ...]:
        return tuple(planned for _, _, planned in self.spans)

    def device_spans(self) -> list[tuple[float, float, int | None]] | None:
        """(start s, end s, planned MHz) per computation on the device's clock; None until the
        device has reached every marker."""
        spans = []
        for start, end, planned in self.spans:
            begin = start.device_time_s()
            finish = end.device_time_s() if end is not None else None
            if begin is None or finish is None:
                return None
            spans.append((begin, finish, planned))
        return spans


class ClockSequencer:
    """Turns one stage's per-computation plan into marker-ordered controller requests."""

    def __init__(self, controller: ClockControl, timeline: DeviceTimeline, *, communication_clock: int | None = None,
                 latency: SwitchLatency | None = None) -> None:
        """latency: the GPU's clock-change latency, to issue changes ahead of time (None: apply
        each change when the device ends the previous computation)."""
        self.controller = controller
        self.timeline = timeline
        self.communication_clock = communication_clock
        self.latency = latency
        self._clocks: tuple[int, ...] | None = None
        self._durations_s: tuple[float, ...] | None = None
        self._planned_ends_s: list[float] = []  # [0, planned end of each computation] from iteration start
        self._planned_starts_s: list[float] = []  # planned start of each computation from iteration start
        # device offsets of the last completed iteration, and of the latest one per clock plan
        # (a baseline probe or a straggler plan in between does not lose a plan's timeline)
        self._last_offsets: list[tuple[float, float]] = []
        self._completed: dict[tuple[int | None, ...], list[tuple[float, float]]] = {}
        self._unresolved: list[IterationTrace] = []  # recent traces the device may not have finished
        self._ends: list[DeviceMarker] = []
        self._previous_last_end: DeviceMarker | None = None  # of the iteration before the last
        self._last_first_start: DeviceMarker | None = None  # of the last iteration
        self._position = 0
        self._locked = False
        self._recovery: RecoveryProgram | None = None
        self.trace = IterationTrace(-1)

    def start_iteration(self, iteration: int, clocks: tuple[int, ...] | None,
                        durations_s: tuple[float, ...] | None = None,
                        recovery: RecoveryProgram | None = None) -> DeviceMarker:
        """Record the iteration's start marker and queue its first clock there (None: default
        clocks). `durations_s`: each computation's planned duration, for issuing changes ahead
        of time; `recovery`: the plan is slowed for a straggler, and this is what the device
        runs instead once that straggler episode is overridden. Returns the marker, which the
        caller also observes for time and energy."""
        last_end = self._ends[-1] if len(self._ends) > 1 else None
        gap_s = self._between_iterations_s()
        self._previous_last_end = last_end
        self._last_first_start = None
        marker = self.timeline.record_marker()
        self.timeline.anchor_at(marker)
        self._clocks = clocks
        self._durations_s = durations_s
        self._recovery = recovery if clocks is not None and recovery is not None \
            and len(recovery.clocks) == len(clocks) else None
        self._unresolved = [*self._unresolved[-2:], self.trace]
        if durations_s is not None:
            self._plan_timeline(durations_s)
        self._ends = [marker]  # _ends[j + 1]: end of computation j; _ends[0]: iteration start
        self._position = 0
        self.trace = IterationTrace(iteration, start=marker)
        if clocks is not None:
            if self._ahead_s > 0 and last_end is not None and gap_s is not None:
                # The ramp ends as the first computation starts (or lands as early as it can),
                # and the change goes out no later than the device reaching this iteration's
                # start: a last gap that was long (evaluation, a checkpoint, an inline solve)
                # must not hold it back into the computations.
                lead_s = self._ahead_s + self.controller.issue_delay.typical_s
                self._set(clocks[0], last_end, max(0.0, gap_s - lead_s), by=marker)
            else:
                self._set(clocks[0], marker)
            self._queue_recovery(marker)
            self._locked = True
        elif self._locked:
            self.release(marker)
        return marker

    @property
    def landing_window_s(self) -> float:
        """How far from the computation boundary it serves a clock change may take hold: the
        switch latency, the ramp and the controller's typical delay."""
        return self._ahead_s + self.controller.issue_delay.typical_s

    @property
    def _ahead_s(self) -> float:
        """Switch latency plus ramp: how long before a clock is fully in force it is issued."""
        return 0.0 if self.latency is None else self.latency.issue_to_change_s + self.latency.transition_s

    def _plan_timeline(self, durations_s: tuple[float, ...]) -> None:
        """Planned start and end of each computation from the iteration start: the device's own
        timeline of the latest completed iteration with the same clocks (ramps and waits
        included), else the last completed iteration's waits plus the planned durations (no
        waits known: none)."""
        for trace in reversed(self._unresolved):
            offsets = trace.device_offsets()
            if offsets is not None:
                self._unresolved = [t for t in self._unresolved if t.iteration > trace.iteration]
                self._completed.pop(trace.planned_clocks, None)
                self._completed[trace.planned_clocks] = offsets
                self._last_offsets = offsets
                while len(self._completed) > TIMELINES_KEPT:
                    del self._completed[next(iter(self._completed))]
                break
        same = self._completed.get(self._clocks) if self._clocks is not None else None
        if same is not None and len(same) == len(durations_s):
            self._planned_starts_s = [begin for begin, _ in same]
            self._planned_ends_s = [0.0, *(end for _, end in same)]
            return
        offsets = self._last_offsets
        if len(offsets) != len(durations_s):
            offsets = [(0.0, 0.0)] * len(durations_s)  # nothing known of this schedule: no waits
        starts, ends, at, previous_end = [], [0.0], 0.0, 0.0
        for (begin, end), duration in zip(offsets, durations_s):
            at += max(0.0, begin - previous_end)  # the device's wait before this computation
            previous_end = end
            starts.append(at)
            at += duration
            ends.append(at)
        self._planned_starts_s, self._planned_ends_s = starts, ends

    def _gap_too_short_for_default(self) -> bool:
        """Whether the gap between iterations (last measured) ends before a change to the default
        clock issued at the last computation's end could be complete: the reset would then only
        land in the next iteration's first computation, so the stage keeps its last clock."""
        gap_s = self._between_iterations_s()
        return self._ahead_s > 0 and gap_s is not None and gap_s < self._ahead_s

    def _between_iterations_s(self) -> float | None:
        """The device time from the previous iteration's last computation to the last
        iteration's first one (None until both markers are reached); never blocks."""
        end, start = self._previous_last_end, self._last_first_start
        if end is None or start is None or not start.query():
            return None
        end_s, start_s = end.device_time_s(), start.device_time_s()
        return None if end_s is None or start_s is None else start_s - end_s

    def computation_started(self) -> None:
        """Right before the computation's work is launched (after its receive)."""
        marker = self.timeline.record_marker()
        if self._position == 0:
            self._last_first_start = marker
        planned = self.planned_clock()
        if self.communication_clock is not None and planned is not None and self._position > 0:
            self._set(planned, marker)
        self.trace.spans.append((marker, None, planned))

    def computation_finished(self) -> DeviceMarker:
        """Right after the computation's work is launched: queue what the device runs next."""
        marker = self.timeline.record_marker()
        start, _, planned = self.trace.spans[-1]
        self.trace.spans[-1] = (start, marker, planned)
        self._ends.append(marker)
        self._position += 1
        upcoming = self.planned_clock()
        if self._clocks is None:
            return marker
        if upcoming is None:
            if not self._gap_too_short_for_default():
                self.release(marker)
        elif self.communication_clock is not None:
            self._set(self.communication_clock, marker)
        elif upcoming != planned and self._durations_s is not None and self._ahead_s > 0:
            self._set(upcoming, *self._ahead())
        else:
            self._set(upcoming, marker)
        if upcoming is not None:
            self._queue_recovery(marker)
        return marker

    def _set(self, mhz: int, at: DeviceMarker, after_s: float = 0.0, by: DeviceMarker | None = None) -> None:
        """A change of the plan in force, tagged with its straggler episode when it has one."""
        if self._recovery is None:
            self.controller.set_clock(mhz, at=at, after_s=after_s, by=by)
        else:
            self.controller.set_clock(mhz, at=at, after_s=after_s, by=by, episode=self._recovery.episode)

    def _queue_recovery(self, marker: DeviceMarker) -> None:
        """The recovery program's change for the computation about to come, at `marker`."""
        if self._recovery is not None:
            self.controller.queue_recovery(self._recovery.clock_from(self._position), marker,
                                           self._recovery.episode)

    def _ahead(self) -> tuple[DeviceMarker, float]:
        """(marker, delay) at which to issue the next computation's clock: its ramp starts as the
        previous computation ends, later by as much of the wait before the next one as the ramp
        leaves free (the ramp then ends as the next one starts), but never later than the switch
        latency after that end (as early as a change tied to it can land: waits vary). Issued
        earlier by how late the controller's worker typically is (`issue_delay.py`), and tied
        to the latest computation end planned at or before that time."""
        latency = self.latency
        ends = self._planned_ends_s  # ends[j + 1]: planned end of computation j (ends[0] = 0)
        previous_end = ends[self._position]
        wait = self._planned_starts_s[self._position] - previous_end
        lag_s = latency.issue_to_change_s  # the set call's own duration, then the switch
        ramp_start = previous_end + max(0.0, min(wait - latency.transition_s, lag_s))
        issue = ramp_start - lag_s - self.controller.issue_delay.typical_s
        if issue <= 0.0:
            return self._ends[0], 0.0  # not enough planned work before it: as early as possible
        j = bisect.bisect_right(ends, issue, 0, self._position + 1) - 1  # latest end at or before it
        return self._ends[j], issue - ends[j]

    def planned_clock(self) -> int | None:
        """The clock planned for the computation about to run (None: default clocks)."""
        clocks = self._clocks
        if clocks is None or self._position >= len(clocks):
            return None
        return clocks[self._position]

    @property
    def position(self) -> int:
        """How many computations of the current iteration have been launched."""
        return self._position

    def release(self, at: DeviceMarker | None = None) -> None:
        """Back to the default clocks from marker `at` (None: at once) until a plan is given."""
        self.controller.reset(at=at)
        self._clocks = None
        self._locked = False
