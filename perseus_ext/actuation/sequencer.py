"""Planned clocks in force while the device runs the computations they were planned for.

The training thread only *launches* work; the GPU runs it later. So a clock change is tied to a
device marker (a CUDA event) recorded at the computation boundary, and the controller's worker
applies it when the device reaches that marker:

* iteration start marker  -> the first computation's clock (the device has finished the previous
  iteration's optimizer step, which ran at the default clock);
* end of computation k    -> computation k+1's clock, so the switch happens while the stage waits
  for its next input (for a receive-bound stage that is the start of the communication gap);
  with a communication clock, that clock instead, and k+1's clock at k+1's start marker;
* end of the last computation -> the default clocks: the gradient all-reduce, the optimizer step,
  evaluation and checkpointing run on every stage's critical path, so they get the default clock.

Recording a marker costs microseconds and never synchronises; the markers are also kept per
computation so the clock coverage can be estimated from device timestamps.
"""

from __future__ import annotations

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

    def __init__(self, controller: Any, timeline: DeviceTimeline, *, communication_clock: int | None = None) -> None:
        self.controller = controller
        self.timeline = timeline
        self.communication_clock = communication_clock
        self._clocks: tuple[int, ...] | None = None
        self._position = 0
        self._locked = False
        self.trace = IterationTrace(-1)

    def start_iteration(self, iteration: int, clocks: tuple[int, ...] | None) -> DeviceMarker:
        """Record the iteration's start marker and queue its first clock there (None: default
        clocks). Returns the marker, which the caller also observes for time and energy."""
        marker = self.timeline.record_marker()
        self._clocks = clocks
        self._position = 0
        self.trace = IterationTrace(iteration)
        if clocks is not None:
            self.controller.set_clock(clocks[0], at=marker)
            self._locked = True
        elif self._locked:
            self.release(marker)
        return marker

    def computation_started(self) -> None:
        """Right before the computation's work is launched (after its receive)."""
        marker = self.timeline.record_marker()
        planned = self.planned_clock()
        if self.communication_clock is not None and planned is not None and self._position > 0:
            self.controller.set_clock(planned, at=marker)
        self.trace.spans.append((marker, None, planned))

    def computation_finished(self) -> DeviceMarker:
        """Right after the computation's work is launched: queue what the device runs next."""
        marker = self.timeline.record_marker()
        start, _, planned = self.trace.spans[-1]
        self.trace.spans[-1] = (start, marker, planned)
        self._position += 1
        upcoming = self.planned_clock()
        if self._clocks is None:
            return marker
        if upcoming is None:
            self.release(marker)
        elif self.communication_clock is not None:
            self.controller.set_clock(self.communication_clock, at=marker)
        else:
            self.controller.set_clock(upcoming, at=marker)
        return marker

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
