"""A simulated GPU's compute stream: the `DeviceTimeline` the runtime launches work on and records
markers in, over the simulated device (`device.py`), joined to its job's cross-rank board
(`board.py`) so that ranks' devices wait for each other's results like NCCL waits on streams."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from perseus_ext.measurement.gpu.sim.board import Board
from perseus_ext.measurement.gpu.sim.device import SimDevice
from perseus_ext.measurement.gpu.timeline import CoverageTally, DeviceMarker, DeviceTimeline


class SimulatedTimeline(DeviceTimeline):
    """A simulated GPU's compute stream, joined to its job's cross-rank board."""

    def __init__(self, device: SimDevice, *, kind_counts: dict[str, int],
                 slowdown: Callable[[], float], board: Board | None = None,
                 peer_timeout_s: float | None = None) -> None:
        self.device = device
        self.board = board
        self._kind_counts = kind_counts
        self._slowdown = slowdown
        if board is not None:
            with device.cond:
                device.board = board
                device.peer_timeout_s = peer_timeout_s

    def record_marker(self) -> DeviceMarker:
        return self.device.record_marker()

    def synchronize(self) -> None:
        self.device.synchronize()

    def launch(self, label: str, seconds_at_max_clock: float, *,
               planned_clock_mhz: int | None = None, after: Sequence[str] = (),
               publish: str | None = None) -> None:
        self._kind_counts[label] = self._kind_counts.get(label, 0) + 1
        self.device.launch(seconds_at_max_clock, slowdown=self._slowdown(),
                           planned_clock_mhz=planned_clock_mhz, after=after, publish=publish)

    def exact_coverage(self) -> CoverageTally | None:
        return self.device.tally()

    def power_bins(self, start_s: float, end_s: float, period_s: float) -> tuple[int, np.ndarray] | None:
        return self.device.power_bins(start_s, end_s, period_s)

    def close(self) -> None:
        """Leave the board (removed by the last rank to leave); the device keeps running."""
        if self.board is None:
            return
        with self.device.cond:
            if self.device.board is self.board:
                self.device.board = None
        self.board.close()
        self.board = None
