"""`ClockControl`: what the sequencer, the recorder, profiling and power-limit mode ask of a clock
controller -- requests that never block the training thread, tied to device markers, plus the
measurements the controller's threads take. `FrequencyController` (controller.py) is the one
implementation; tests may stand in for it with anything that has these members."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from perseus_ext.actuation.controller import ClockChange
    from perseus_ext.actuation.issue_delay import IssueDelay
    from perseus_ext.actuation.observer import Observation
    from perseus_ext.measurement.gpu.timeline import DeviceMarker


class ClockControl(Protocol):
    """Non-blocking clock and power-limit requests on one GPU, ordered by device markers."""

    issue_delay: IssueDelay  # how late marker-tied changes go out (the sequencer issues earlier)

    @property
    def current_clock(self) -> int | None:
        """The clock last applied (None: default clocks)."""

    def set_clock(self, mhz: int, at: DeviceMarker | None = None, after_s: float = 0.0,
                  by: DeviceMarker | None = None, episode: int | None = None) -> None:
        """`mhz` from marker `at` on (`after_s` later, or at `by` if the device gets there first);
        `episode`: the straggler episode whose slowed plan it serves (dropped once it recovered)."""

    def queue_recovery(self, mhz: int, at: DeviceMarker, episode: int) -> None:
        """Straggler `episode`'s fastest-plan clock from marker `at` on, applied only once the
        episode is found recovered (the slowed changes it shadows are then dropped)."""

    def reset(self, at: DeviceMarker | None = None) -> None:
        """The default clocks from marker `at` on."""

    def set_power_limit(self, watts: float) -> None:
        """A GPU power limit (power-limit mode)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every request so far went out (profiling only); True if it did in time."""

    def observe(self, at: DeviceMarker, tag: Any) -> None:
        """Time and meter marker `at` when the device reaches it."""

    def observations(self) -> list[Observation]:
        """The markers observed since the last call."""

    def drain_changes(self) -> list[ClockChange]:
        """The clock changes applied since the last call, with their times."""
