"""Time and energy of a window of GPU work, and per-computation energy from many windows.

Why aggregation: NVML's energy counter updates only every few tens of milliseconds (100 ms on the
simulated presets), while one forward of a pipeline stage can take a few milliseconds. A single
window around one forward therefore reads 0 or a whole update's worth of energy. Instead we
measure many windows, each holding known counts of labelled computations (e.g. 3 x
"forward@1200" and 2 x "backward@1200") plus known idle time, and solve the linear system

    energy_i = sum_l count_il * e_l + P_idle * idle_i          (least squares over windows i)

for the per-computation energies e_l. With `align=True` a window starts and ends exactly on
counter updates (it polls the counter until it changes), which removes the counter's
quantisation from every window; the idle wait until the update is counted as idle time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from perseus_ext.errors import PerseusError
from perseus_ext.measurement.gpu.common import GPU

logger = logging.getLogger(__name__)


class MeasurementError(PerseusError, ValueError):
    """Measurements cannot answer the question asked (too few or too similar windows)."""


# --------------------------------------------------------------------------- energy counter
class EnergyMeter:
    """Reads a GPU's energy counter without ever raising into the caller.

    A failed read returns None (counted in `error_count`, logged once), so a flaky NVML makes a
    window lose its energy, not the training run its step.
    """

    def __init__(
        self, gpu: GPU, *, poll_interval_s: float = 0.001, max_wait_s: float = 2.0
    ) -> None:
        if poll_interval_s <= 0 or max_wait_s <= 0:
            raise MeasurementError(
                f"poll_interval_s={poll_interval_s}, max_wait_s={max_wait_s}: both must be > 0"
            )
        self.gpu = gpu
        self.poll_interval_s = poll_interval_s
        self.max_wait_s = max_wait_s
        self.error_count = 0
        self._logged = False

    def read(self) -> tuple[float, int | None]:
        """(timestamp, counter mJ or None) right now."""
        timestamp = self.gpu.timestamp()
        try:
            return timestamp, self.gpu.energy_mj()
        except Exception as err:  # a failing read must never break the caller's step
            self._note_error(err)
            return timestamp, None

    def read_at_update(self) -> tuple[float, int | None]:
        """Poll until the counter changes; (time of the change, new value), None on failure."""
        _, first = self.read()
        if first is None:
            return self.gpu.timestamp(), None
        deadline = self.gpu.timestamp() + self.max_wait_s
        while True:
            self.gpu.wait(self.poll_interval_s)
            timestamp, value = self.read()
            if value is None:
                return timestamp, None
            if value != first:
                return timestamp, value
            if timestamp > deadline:
                self._note_error(
                    MeasurementError(f"energy counter did not change within {self.max_wait_s} s")
                )
                return timestamp, None

    def _note_error(self, err: BaseException) -> None:
        self.error_count += 1
        if not self._logged:
            self._logged = True
            logger.warning(
                "perseus-ext: %s: energy counter read failed (%s); affected measurement windows "
                "have no energy, training is unaffected. Further failures are only counted.",
                self.gpu.name, err,
            )


@dataclass(frozen=True)
class CounterCalibration:
    """What the energy counter really offers on this device."""

    update_period_s: float  # median time between value changes
    update_period_p90_s: float
    median_step_mj: float  # median change per update
    min_step_mj: int  # smallest change seen (resolution in practice)
    read_cost_s: float  # median wall cost of one energy_mj() call
    updates: int


def calibrate_counter(gpu: GPU, *, updates: int = 20, poll_interval_s: float = 0.0005) -> CounterCalibration:
    """Watch the counter for `updates` changes to learn its update period and step size."""
    if updates < 2:
        raise MeasurementError(f"updates={updates}; need at least 2 counter changes")
    change_times: list[float] = []
    steps: list[int] = []
    read_costs: list[float] = []
    previous = gpu.energy_mj()
    deadline = gpu.timestamp() + 10.0 + updates * 1.0
    while len(change_times) < updates + 1:
        gpu.wait(poll_interval_s)
        started = time.perf_counter()
        value = gpu.energy_mj()
        read_costs.append(time.perf_counter() - started)
        now = gpu.timestamp()
        if value != previous:
            change_times.append(now)
            steps.append(value - previous)
            previous = value
        if now > deadline:
            raise MeasurementError(
                f"{gpu.name}: only {len(change_times)} energy counter changes in "
                f"{10 + updates} s; the counter seems frozen"
            )
    periods = np.diff(change_times)
    return CounterCalibration(
        update_period_s=float(np.median(periods)),
        update_period_p90_s=float(np.percentile(periods, 90)),
        median_step_mj=float(np.median(steps[1:])),
        min_step_mj=int(min(steps[1:])),
        read_cost_s=float(np.median(read_costs)),
        updates=len(periods),
    )


# --------------------------------------------------------------------------- timers
class WallTimer:
    """Computation times from the device's clock (wall clock, or the simulator's clock)."""

    def __init__(self, gpu: GPU) -> None:
        self._clock = gpu.timestamp

    def start(self) -> Any:
        return self._clock()

    def stop(self, token: Any) -> Any:
        return self._clock() - token

    def resolve(self, pending: Any) -> float:
        return float(pending)

    def synchronize(self) -> None:
        """Wall-clock work is synchronous: nothing to wait for."""


class CudaEventTimer:
    """Computation times from CUDA events; no synchronisation until the window ends."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def start(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token: Any) -> Any:
        end = self._torch.cuda.Event(enable_timing=True)
        end.record()
        return token, end

    def resolve(self, pending: Any) -> float:
        start, end = pending
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()


def _cuda_timing_available(gpu: GPU) -> bool:
    """CUDA events time a real GPU's work; never initialise CUDA just to find out."""
    from perseus_ext.measurement.gpu.nvml import NVMLGPU

    torch = sys.modules.get("torch")
    return isinstance(gpu, NVMLGPU) and torch is not None and torch.cuda.is_initialized()


# --------------------------------------------------------------------------- windows
@dataclass
class WindowRecord:
    """One measured window: what ran in it, how long it took, how much energy it used."""

    counts: dict[str, int]
    duration_s: float
    energy_j: float | None  # None when the counter could not be read
    busy_s: dict[str, float] = field(default_factory=dict)  # summed time per label, if timed

    @property
    def idle_s(self) -> float:
        """Window time not spent in timed computations (what the GPU idled or blocked)."""
        return max(0.0, self.duration_s - sum(self.busy_s.values()))


class MeasurementWindow:
    """Measures one window of work; open with `with MeasurementWindow(...) as window:`.

    Inside, report each computation with `window.computation(label)` (times it) or
    `window.add(label, seconds)` (time known, e.g. returned by SimulatedGPU.run). After the
    block, `window.record` holds the WindowRecord.
    """

    def __init__(
        self,
        gpu: GPU,
        *,
        meter: EnergyMeter | None = None,
        timing: str = "auto",
        align: bool = False,
    ) -> None:
        """timing: "cuda" (CUDA events), "wall" (the device's clock) or "auto" (CUDA events for
        a real GPU once torch has initialised CUDA, else wall)."""
        if timing not in ("auto", "wall", "cuda"):
            raise MeasurementError(f"timing={timing!r}; use 'auto', 'wall' or 'cuda'")
        if timing == "auto":
            timing = "cuda" if _cuda_timing_available(gpu) else "wall"
        self.gpu = gpu
        self.meter = meter or EnergyMeter(gpu)
        self.timer: WallTimer | CudaEventTimer = (
            CudaEventTimer() if timing == "cuda" else WallTimer(gpu)
        )
        self.align = align
        self.record: WindowRecord | None = None
        self._counts: dict[str, int] = {}
        self._busy: dict[str, float] = {}
        self._pending: list[tuple[str, Any]] = []
        self._start: tuple[float, int | None] | None = None

    def begin(self) -> "MeasurementWindow":
        self.timer.synchronize()  # earlier queued work must not leak into this window
        self._start = self.meter.read_at_update() if self.align else self.meter.read()
        return self

    def end(self) -> WindowRecord:
        if self._start is None:
            raise MeasurementError("MeasurementWindow.end() called before begin()")
        self.timer.synchronize()
        end_time, end_mj = self.meter.read_at_update() if self.align else self.meter.read()
        for label, pending in self._pending:
            self._busy[label] = self._busy.get(label, 0.0) + self.timer.resolve(pending)
        self._pending.clear()
        start_time, start_mj = self._start
        energy = None if start_mj is None or end_mj is None else (end_mj - start_mj) / 1000.0
        self.record = WindowRecord(dict(self._counts), end_time - start_time, energy, dict(self._busy))
        return self.record

    @contextlib.contextmanager
    def computation(self, label: str) -> Iterator[None]:
        """Time one computation of `label` with this window's timer."""
        token = self.timer.start()
        yield
        self._pending.append((label, self.timer.stop(token)))
        self._counts[label] = self._counts.get(label, 0) + 1

    def add(self, label: str, seconds: float | None = None, count: int = 1) -> None:
        """Report `count` computations of `label` that took `seconds` in total (if known)."""
        self._counts[label] = self._counts.get(label, 0) + count
        if seconds is not None:
            self._busy[label] = self._busy.get(label, 0.0) + seconds

    def __enter__(self) -> "MeasurementWindow":
        return self.begin()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.end()


# --------------------------------------------------------------------------- estimation
@dataclass(frozen=True)
class LabelEstimate:
    label: str
    energy_j: float  # per computation
    stderr_j: float  # standard error of energy_j (from the fit's residuals)
    time_s: float | None  # mean measured time per computation, if windows timed it
    count: int  # computations of this label over all windows

    @property
    def power_w(self) -> float | None:
        return self.energy_j / self.time_s if self.time_s else None


@dataclass(frozen=True)
class EnergyEstimate:
    labels: dict[str, LabelEstimate]
    idle_power_w: float  # given, or estimated from the windows
    windows: int
    residual_rms_j: float

    def __getitem__(self, label: str) -> LabelEstimate:
        return self.labels[label]


OUTLIER_ROUNDS = 3  # fits after the first one, each without the previous fit's outliers
ROBUST_SD_PER_MAD = 1.4826  # standard deviation per median absolute deviation (normal noise)


class EnergyEstimator:
    """Least-squares per-computation energy from many WindowRecords (see module doc)."""

    def __init__(self, idle_power_w: float | None = None, *, outlier_mads: float | None = None) -> None:
        """idle_power_w: the GPU's idle/blocking power if known; None = estimate it too.
        outlier_mads: leave out windows whose residual exceeds this many robust standard
        deviations (1.4826 x the residuals' median absolute deviation), then fit again: a
        window bounded by a stale counter read carries another window's energy, and one such
        pair inflates every standard error several times. None keeps every window."""
        if idle_power_w is not None and not (math.isfinite(idle_power_w) and idle_power_w >= 0):
            raise MeasurementError(f"idle_power_w={idle_power_w}; it must be a finite number >= 0")
        if outlier_mads is not None and not outlier_mads > 0:
            raise MeasurementError(f"outlier_mads={outlier_mads}; it must be > 0 or None")
        self.idle_power_w = idle_power_w
        self.outlier_mads = outlier_mads
        self.records: list[WindowRecord] = []

    def add(self, record: WindowRecord) -> None:
        self.records.append(record)

    def extend(self, records: Iterable[WindowRecord]) -> None:
        self.records.extend(records)

    def estimate(self) -> EnergyEstimate:
        usable = [r for r in self.records if r.energy_j is not None and r.counts]
        estimate = self._fit(usable)
        for _ in range(OUTLIER_ROUNDS if self.outlier_mads is not None else 0):
            residuals = np.array([r.energy_j - self._predicted(r, estimate) for r in usable])
            spread = ROBUST_SD_PER_MAD * float(np.median(np.abs(residuals - np.median(residuals))))
            inliers = [r for r, res in zip(usable, residuals) if abs(res) <= self.outlier_mads * spread]
            if spread <= 0 or len(inliers) == len(usable):
                break
            try:
                estimate, usable = self._fit(inliers), inliers
            except MeasurementError:  # the outliers were needed to separate the unknowns
                break
        return estimate

    @staticmethod
    def _predicted(record: WindowRecord, estimate: EnergyEstimate) -> float:
        return (sum(count * estimate.labels[label].energy_j for label, count in record.counts.items())
                + estimate.idle_power_w * record.idle_s)

    def _fit(self, usable: list[WindowRecord]) -> EnergyEstimate:
        labels = sorted({label for r in usable for label in r.counts})
        if not labels:
            raise MeasurementError(
                "no window with both an energy reading and labelled computations; record windows "
                "with MeasurementWindow.add()/computation() first"
            )
        columns = [[r.counts.get(label, 0) for label in labels] for r in usable]
        matrix = np.array(columns, dtype=float)
        energy = np.array([r.energy_j for r in usable], dtype=float)
        idle = np.array([r.idle_s for r in usable], dtype=float)
        estimate_idle = self.idle_power_w is None
        if estimate_idle:
            matrix = np.column_stack([matrix, idle])
        else:
            energy = energy - self.idle_power_w * idle
        unknowns = matrix.shape[1]
        if len(usable) < unknowns or np.linalg.matrix_rank(matrix) < unknowns:
            what = [str(label) for label in labels] + (["idle power"] if estimate_idle else [])
            raise MeasurementError(
                f"{len(usable)} usable window(s) cannot separate {', '.join(what)}: record at "
                f"least {unknowns} windows whose label counts (and idle time, if the idle power "
                f"is unknown) vary independently, or pass idle_power_w"
            )
        solution, _, _, _ = np.linalg.lstsq(matrix, energy, rcond=None)
        residual = energy - matrix @ solution
        dof = len(usable) - unknowns
        sigma2 = float(residual @ residual) / dof if dof else 0.0
        stderr = np.sqrt(np.diag(np.linalg.inv(matrix.T @ matrix)) * sigma2)
        result = {}
        for index, label in enumerate(labels):
            count = int(sum(r.counts.get(label, 0) for r in usable))
            timed = [r for r in usable if label in r.busy_s]
            timed_count = sum(r.counts[label] for r in timed)
            time_s = sum(r.busy_s[label] for r in timed) / timed_count if timed_count else None
            result[label] = LabelEstimate(
                label, float(solution[index]), float(stderr[index]), time_s, count
            )
        idle_power = float(solution[-1]) if estimate_idle else float(self.idle_power_w)
        return EnergyEstimate(
            result, idle_power, len(usable), float(np.sqrt(np.mean(residual**2)))
        )
