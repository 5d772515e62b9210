"""One rank's iteration records, from the device's point of view, without waiting for it.

The host finishes launching an iteration long before the GPU finishes running it, so a record
cannot be written at `iteration_end`. Instead the recorder asks the controller's worker to
observe the iteration's start, compute-end and end markers (time and energy counter when the
device reaches them), and turns an iteration into an `IterationRecord` once all three have been
observed -- usually one iteration later. Records go to the history, the rank's feed (what the
metrics writers read: `observability.feed`), the JSONL log (`observability.log_row.LogRow`,
appended, so a restarted job keeps its earlier lines) and one concise line every `log_interval` iterations
(INFO on rank 0, DEBUG elsewhere, so a job's console shows one line, not one per stage): what the
iteration really ran (a fallen-back rank says so whatever the phase), its time and energy, and the
saving of this rank's stage measured against the baseline probes so far -- labelled as the stage's,
since the job's (energy summed over every GPU) differs and is known only at close. Where the
device knows its power finely (the simulated GPU), a record also carries the power per
millisecond from the previous iteration's end marker to its own (`observability.power_samples`:
the measured power swing).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from perseus_ext.actuation.clock_control import ClockControl
from perseus_ext.actuation.sequencer import IterationTrace
from perseus_ext.measurement.coverage import estimate_coverage
from perseus_ext.measurement.gpu.timeline import DeviceMarker, SwitchLatency
from perseus_ext.observability.feed import RankFeed
from perseus_ext.observability.iteration import IterationRecord, IterationSetting
from perseus_ext.observability.log_row import LogRow
from perseus_ext.observability.power_samples import MAX_ITERATIONS, POWER_BIN_S, PowerSamples
from perseus_ext.observability.run_figures import label_of
from perseus_ext.observability.saving_estimate import Comparison

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

START, COMPUTE_END, END = "start", "compute_end", "end"
# (start, end, bin seconds) of device time -> (first bin, mean watts per bin) or None
PowerBins = Callable[[float, float, float], "tuple[int, np.ndarray] | None"]
WAIT_POLL_S = 0.001
POWER_KEPT = 2 * MAX_ITERATIONS  # records that keep their power samples in the history


@dataclass
class _Pending:
    setting: IterationSetting
    trace: IterationTrace | None = None
    wall_time: float = 0.0
    compute_observed: bool = False
    seen: dict[str, tuple[float, int | None]] = field(default_factory=dict)  # tag -> (device s, mJ)


class RunRecorder:
    """Pending iterations in, finished `IterationRecord`s out, in iteration order."""

    def __init__(self, controller: ClockControl, *, rank: int, pipeline: int, stage: int, latency: SwitchLatency,
                 log_path: str | None, log_interval: int, job_id: str | None = None,
                 on_record: Callable[[IterationRecord], None] | None = None,
                 saving: Callable[[], Comparison | None] | None = None, feed: RankFeed | None = None,
                 default_clock_mhz: float | None = None, power_bins: PowerBins | None = None) -> None:
        """default_clock_mhz: the clock an iteration at default clocks is planned to run (the
        GPU's maximum; None when the GPU cannot say). power_bins: the device's fine power
        samples (`DeviceTimeline.power_bins`; None or answering None on real GPUs)."""
        self.controller = controller
        self.rank, self.pipeline, self.stage = rank, pipeline, stage
        self.job_id = job_id  # every row names its job: `perseus-ext report` never merges two jobs
        self.latency = latency
        self.log_interval = log_interval
        self.history: list[IterationRecord] = []
        self._pending: dict[int, _Pending] = {}
        self._changes: list[tuple[float, int | None]] = []
        self._clock_before: int | None = None  # the clock in force before self._changes[0]
        self._on_record = on_record
        self._saving = saving
        self.feed = feed
        self.default_clock_mhz = default_clock_mhz
        self._power_bins = power_bins
        self._previous_end: tuple[int, float] | None = None  # (iteration, device time of its end marker)
        self.log_failure: str | None = None  # why the log stopped (clocks are planned on regardless)
        self._log_path: Path | None = None
        self._log_file = None
        self._log_file = self._open_log(log_path)

    def _open_log(self, template: str | None):
        if template is None:
            return None
        self._log_path = Path(template.format(rank=self.rank))
        try:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            return open(self._log_path, "a", encoding="utf-8")
        except OSError as err:
            self._log_failed("cannot open", err)
            return None

    def _log_failed(self, what: str, err: OSError) -> None:
        """The log's failure is the log's alone: said once, naming the key and the file; the
        log stops, the optimisation and the in-memory records go on."""
        self.log_failure = (f"{what} perseus.log_path {self._log_path}: {err.strerror or err}; the log stops here, "
                            "clocks are still planned and the summary keeps its figures (free space or point "
                            "perseus.log_path elsewhere)")
        logger.error("perseus-ext: rank %d: %s", self.rank, self.log_failure)
        if self._log_file is not None:
            try:
                self._log_file.close()
            except OSError:
                pass  # the buffered line that could not be written fails again: nothing more to say
            self._log_file = None

    # ------------------------------------------------------------------ training thread
    def begin(self, setting: IterationSetting, start: DeviceMarker) -> None:
        self._pending[setting.iteration] = _Pending(setting)
        self.controller.observe(start, (setting.iteration, START))

    def compute_end(self, iteration: int, marker: DeviceMarker) -> None:
        """The stage's computations end at `marker` (the data-parallel wait follows)."""
        pending = self._pending.get(iteration)
        if pending is not None and not pending.compute_observed:
            pending.compute_observed = True
            self.controller.observe(marker, (iteration, COMPUTE_END))

    def end(self, iteration: int, marker: DeviceMarker, trace: IterationTrace) -> None:
        pending = self._pending.get(iteration)
        if pending is None:
            return
        pending.trace = trace
        pending.wall_time = time.time()
        self.compute_end(iteration, marker)  # adapters without a compute-end hook
        self.controller.observe(marker, (iteration, END))

    def collect(self) -> list[IterationRecord]:
        """Finish every iteration the device has completed; never blocks."""
        for observation in self.controller.observations():
            iteration, tag = observation.tag
            pending = self._pending.get(iteration)
            if pending is not None:
                pending.seen[tag] = (observation.device_time_s, observation.energy_mj)
        self._changes.extend((c.issued_s, c.mhz) for c in self.controller.drain_changes())
        finished = []
        for iteration in sorted(self._pending):
            pending = self._pending[iteration]
            if len(pending.seen) < 3 or pending.wall_time == 0.0:
                break  # records come out in iteration order
            finished.append(self._finish(self._pending.pop(iteration)))
        return finished

    def wait_for(self, iteration: int, timeout_s: float) -> IterationRecord | None:
        """Block until `iteration` is recorded (power-limit mode feeds its optimizer one
        iteration late, which almost never waits); None after `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        while True:
            self.collect()
            record = next((r for r in reversed(self.history) if r.iteration == iteration), None)
            if record is not None or iteration not in self._pending or time.perf_counter() > deadline:
                return record
            time.sleep(WAIT_POLL_S)

    # ------------------------------------------------------------------ records
    def _finish(self, pending: _Pending) -> IterationRecord:
        """An iteration spans the adapter's hooks: from `iteration_start` to `iteration_end` as
        the device reaches them (DeepSpeed's whole schedule including the optimizer step;
        Megatron's forward-backward, whose optimizer step follows outside it). What the process
        does between iterations -- data loading, evaluation, another engine -- is not charged."""
        (start_s, start_mj), (compute_s, _), (end_s, end_mj) = (
            pending.seen[START], pending.seen[COMPUTE_END], pending.seen[END])
        energy = None if start_mj is None or end_mj is None else (end_mj - start_mj) / 1000.0
        record = IterationRecord(
            setting=pending.setting, rank=self.rank, pipeline=self.pipeline, stage=self.stage,
            time_s=end_s - start_s, compute_s=compute_s - start_s, energy_j=energy,
            coverage=self._coverage(pending), wall_time=pending.wall_time,
            clock_mhz=self._planned_clock_mhz(pending), power=self._power(pending.setting.iteration, start_s, end_s),
            first_computation_s=_first_start_s(pending.trace, start_s),
        )
        self.history.append(record)
        self._forget_old_power()
        self._write(record)
        if self._on_record is not None:
            self._on_record(record)
        if self.feed is not None:
            self.feed.publish(record)
        return record

    def _forget_old_power(self) -> None:
        """Keep power samples on the latest `POWER_KEPT` records only: the measured swing reads
        at most `MAX_ITERATIONS` of them, and a long simulated run must not hold every
        millisecond of its history (the log and the feed have had them)."""
        old = len(self.history) - POWER_KEPT - 1
        if old >= 0 and self.history[old].power is not None:
            self.history[old] = dataclasses.replace(self.history[old], power=None)

    def _power(self, iteration: int, start_s: float, end_s: float) -> PowerSamples | None:
        """The device's power samples from the previous iteration's end marker (when that
        iteration was the one before) to this one's end: consecutive records tile device time,
        the gaps between iterations included. A failing read costs the samples, never the record."""
        previous, self._previous_end = self._previous_end, (iteration, end_s)
        if self._power_bins is None:
            return None
        begin = previous[1] if previous is not None and previous[0] == iteration - 1 else start_s
        try:
            bins = self._power_bins(begin, end_s, POWER_BIN_S)
        except Exception as err:  # a device that cannot answer: no samples, the record stands
            logger.debug("perseus-ext: rank %d: no power samples for iteration %d: %s", self.rank, iteration, err)
            return None
        if bins is None:
            return None
        first_bin, watts = bins
        watts.flags.writeable = False
        return PowerSamples(POWER_BIN_S, int(first_bin), watts)

    def _planned_clock_mhz(self, pending: _Pending) -> float | None:
        """The SM clock the iteration was planned to run: the profiled clock, the mean of the
        plan's clocks over the stage's computations (as the sequencer issued them), else the
        default clock."""
        setting = pending.setting
        if setting.profiled_clock_mhz is not None:
            return float(setting.profiled_clock_mhz)
        if setting.plan is not None and pending.trace is not None:
            clocks = [mhz for mhz in pending.trace.planned_clocks if mhz is not None]
            if clocks:
                return sum(clocks) / len(clocks)
        return self.default_clock_mhz

    def _coverage(self, pending: _Pending) -> float | None:
        """Estimated from device timestamps and the controller's issue times (what a real GPU
        allows); only deployed iterations have a plan to cover."""
        spans = pending.trace.device_spans() if pending.trace is not None else None
        if pending.setting.plan is None or pending.setting.fell_back or not spans:
            return None
        begin = spans[0][0]
        keep = [i for i, (issued, _) in enumerate(self._changes) if issued >= begin - 1.0]
        if keep and keep[0] > 0:  # forget changes long before this iteration
            self._clock_before = self._changes[keep[0] - 1][1]
            del self._changes[:keep[0]]
        tally = estimate_coverage(spans, self._changes, self.latency, self._clock_before)
        return tally.coverage

    def _write(self, record: IterationRecord) -> None:
        if self._log_file is not None:
            try:
                self._log_file.write(LogRow.of_record(record, self.job_id).to_json_line() + "\n")
                self._log_file.flush()
            except OSError as err:
                self._log_failed("cannot write to", err)
        if self.log_interval and record.iteration % self.log_interval == 0:
            logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "%s", self.log_line(record))

    def log_line(self, record: IterationRecord) -> str:
        """'perseus-ext it 200 [deployed, plan 3, x1.15] 0.5120 s 612.3 J, coverage 97.0% (rank 0:
        stage 1, pipeline 0); saving of this stage, not the job's (that comes at close): 23.1%
        [19.0, 27.2] (12 probes)'. The saving is this GPU's own: a stage with slack saves more than
        the busiest one, so it is never labelled as the job's figure, and a thin interval says so."""
        setting = record.setting
        label = label_of(setting.phase.value, setting.fell_back, setting.probe)
        what = [label] if label != setting.phase.value or setting.describe() == "default" else [label, setting.describe()]
        if setting.factor is not None and setting.factor > 1.0 and setting.plan is not None:
            what.append(f"x{setting.factor:.2f}")
        parts = [f"perseus-ext it {record.iteration} [{', '.join(what)}] {record.time_s:.4f} s "
                 + (f"{record.energy_j:.1f} J" if record.energy_j is not None else "n/a J")]
        if record.coverage is not None:
            parts.append(f"coverage {100 * record.coverage:.1f}%")
        line = ", ".join(parts) + f" (rank {self.rank}: stage {self.stage}, pipeline {self.pipeline})"
        estimate = self._saving() if self._saving is not None and not setting.fell_back else None
        if estimate is not None:
            line += f"; saving of this stage, not the job's (that comes at close): {estimate.describe_with_evidence()}"
        return line

    def close(self, timeout_s: float) -> None:
        """Record what the device still runs (the controller is flushed first), close the log,
        then the feed (its readers write the last records)."""
        try:
            self.controller.flush(timeout_s)
            self.collect()
            if self._log_file is not None:
                try:
                    self._log_file.close()
                except OSError as err:
                    self._log_failed("cannot write to", err)
                self._log_file = None
        finally:
            if self.feed is not None:
                self.feed.close()


def _first_start_s(trace: IterationTrace | None, start_s: float) -> float | None:
    """When the iteration's first computation started, after the iteration start (device time)."""
    first = trace.spans[0][0].device_time_s() if trace is not None and trace.spans else None
    return None if first is None else first - start_s
