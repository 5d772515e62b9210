"""Planned clocks in force while the device runs the computations they were planned for.

The training thread only *launches* work; the GPU runs it later. So a clock change is tied to a
device marker (a CUDA event) recorded at the computation boundary, and the controller's worker
applies it when the device reaches that marker:

* iteration start marker  -> the first computation's clock (the device has finished the previous
  iteration's optimizer step, which ran at the default clock); once the gap between iterations
  (gradient sync, optimizer step) has been measured, issued ahead instead, the switching latency
  before the next iteration is due to start -- a gap shorter than the latency keeps the last
  clock (no change could land inside it anyway);
* end of computation k    -> computation k+1's clock, so the switch happens while the stage waits
  for its next input (for a receive-bound stage that is the start of the communication gap);
  with a communication clock, that clock instead, and k+1's clock at k+1's start marker;
* when the plan's durations are known, a change is issued ahead by the switching latency
  (`lead_s`): it is tied to the end of an earlier computation j plus a delay, so that it lands
  when computation k+1 is planned to start -- the latency is hidden instead of eating into k+1;
* end of the last computation -> the default clocks: the gradient all-reduce, the optimizer step,
  evaluation and checkpointing run on every stage's critical path, so they get the default clock.

Recording a marker costs microseconds and never synchronises; the markers are also kept per
computation so the clock coverage can be estimated from device timestamps.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline


@dataclass
class IterationTrace:
    """One iteration's computation markers: (start, end, planned clock) per computation."""

    iteration: int
    spans: list[tuple[DeviceMarker, DeviceMarker | None, int | None]] = field(default_factory=list)

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

    def __init__(self, controller: Any, timeline: DeviceTimeline, *, communication_clock: int | None = None,
                 lead_s: float = 0.0) -> None:
        self.controller = controller
        self.timeline = timeline
        self.communication_clock = communication_clock
        self.lead_s = lead_s
        self._clocks: tuple[int, ...] | None = None
        self._durations_s: tuple[float, ...] | None = None
        self._planned_ends_s: list[float] = []  # planned end of each computation from iteration start
        self._ends: list[DeviceMarker] = []
        self._previous_last_end: DeviceMarker | None = None  # of the iteration before the last
        self._last_first_start: DeviceMarker | None = None  # of the last iteration
        self._position = 0
        self._locked = False
        self.trace = IterationTrace(-1)

    def start_iteration(self, iteration: int, clocks: tuple[int, ...] | None,
                        durations_s: tuple[float, ...] | None = None) -> DeviceMarker:
        """Record the iteration's start marker and queue its first clock there (None: default
        clocks). `durations_s`: each computation's planned duration, for issuing changes ahead
        of time. Returns the marker, which the caller also observes for time and energy."""
        last_end = self._ends[-1] if len(self._ends) > 1 else None
        gap_s = self._between_iterations_s()
        self._previous_last_end = last_end
        self._last_first_start = None
        marker = self.timeline.record_marker()
        self._clocks = clocks
        self._durations_s = durations_s
        if durations_s is not None:
            self._planned_ends_s = [0.0, *itertools.accumulate(durations_s)]
        self._ends = [marker]  # _ends[j + 1]: end of computation j; _ends[0]: iteration start
        self._position = 0
        self.trace = IterationTrace(iteration)
        if clocks is not None:
            if self.lead_s > 0 and last_end is not None and gap_s is not None:
                self.controller.set_clock(clocks[0], at=last_end, after_s=max(0.0, gap_s - self.lead_s))
            else:
                self.controller.set_clock(clocks[0], at=marker)
            self._locked = True
        elif self._locked:
            self.release(marker)
        return marker

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
            self.controller.set_clock(planned, at=marker)
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
            self.release(marker)
        elif self.communication_clock is not None:
            self.controller.set_clock(self.communication_clock, at=marker)
        elif upcoming != planned and self._durations_s is not None and self.lead_s > 0:
            self.controller.set_clock(upcoming, *self._ahead())
        else:
            self.controller.set_clock(upcoming, at=marker)
        return marker

    def _ahead(self) -> tuple[DeviceMarker, float]:
        """(marker, delay) that puts a change `lead_s` before the next computation's planned
        start: the latest computation end with at least `lead_s` of planned work after it."""
        ends = self._planned_ends_s  # ends[j + 1]: planned end of computation j (ends[0] = 0)
        due = ends[self._position] - self.lead_s  # planned start of the next computation, minus the lead
        if due <= 0.0:
            return self._ends[0], 0.0  # not enough planned work before it: as early as possible
        j = bisect.bisect_right(ends, due, 0, self._position + 1) - 1  # latest end at or before `due`
        return self._ends[j], due - ends[j]

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
