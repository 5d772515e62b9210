"""The profiling phase of one rank, and the pipeline leader's assembly of its stages' profiles.

Profiling iterations are the one place the host waits for the device: each candidate clock is
put in force before the iteration (the controller is flushed and the switching latency waited
out), and the device is synchronised around every computation so counter reads bracket exactly
that computation. The computation itself is timed by device markers around it: the host wakes
from the synchronisation late (about a millisecond on a loaded host), and that idle time must
not count as computing. Deployed iterations never do either, so what they pay between
computations is read off the last warm-up iteration's device markers instead (it ran
unsynchronised, like them; `profiler.py` says how the gaps are split).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable

from perseus_ext.actuation.clock_control import ClockControl
from perseus_ext.actuation.sequencer import IterationTrace
from perseus_ext.errors import PerseusError
from perseus_ext.measurement.gpu.timeline import DeviceMarker, DeviceTimeline
from perseus_ext.measurement.windows import EnergyMeter, MeasurementError
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.runtime.comm import ControlPlane, Member
from perseus_ext.config import PREFIX, PerseusConfig
from perseus_ext.runtime.profiler import StageMeasurements, StageProfiler
from perseus_ext.runtime.rank_setup import RankSetup
from perseus_ext.runtime.records import MeasuredProfile

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0


class ProfilingRun:
    """One stage's profiling: candidate clocks, synchronised timing, counter reads."""

    def __init__(self, profiler: StageProfiler, setup: RankSetup, controller: ClockControl, timeline: DeviceTimeline,
                 free_running: IterationTrace | None = None) -> None:
        """free_running: an iteration run without synchronising (the last warm-up one; not the
        job's first), whose device gaps tell what deployed iterations pay between computations
        (`profiler.py`)."""
        self.profiler = profiler
        self.free_running = free_running
        self.setup = setup
        self.controller = controller
        self.timeline = timeline
        self.meter = EnergyMeter(setup.gpu)
        self.iterations = 0
        self.overhead_s = 0.0
        self._start_s = 0.0
        self._ready_s = 0.0
        self._start_marker: DeviceMarker | None = None
        self._end_marker: DeviceMarker | None = None

    @classmethod
    def create(cls, config: PerseusConfig, stage: int, setup: RankSetup, controller: ClockControl,
               timeline: DeviceTimeline, schedule: PipelineSchedule | None = None,
               free_running: IterationTrace | None = None) -> "ProfilingRun":
        """schedule: tells which computations take a local input (no pipeline wait before
        them), so waits are never counted as framework overhead."""
        local_inputs = None
        if schedule is not None:
            local_inputs = [(producer := schedule.producer_of(c)) is None or producer.stage == stage
                            for c in schedule.orders[stage]]
        profiler = StageProfiler(
            stage, setup.candidate_clocks, iterations_per_clock=config.profiling_iterations_per_clock,
            early_stop=config.early_stop, patience=config.early_stop_patience,
            blocking_power_w=config.blocking_power_w, local_inputs=local_inputs,
        )
        return cls(profiler, setup, controller, timeline, free_running)

    def start_iteration(self) -> None:
        """Put this iteration's candidate clock in force before its first computation."""
        clock = self.profiler.current_clock
        changed = self.controller.current_clock != clock
        self.controller.set_clock(clock)
        self.controller.flush(FLUSH_TIMEOUT_S)
        if changed:
            latency = self.setup.latency
            self.setup.gpu.wait(latency.switch_s + latency.transition_s)
        self.profiler.on_counter(*self.meter.read())

    def before_computation(self) -> None:
        self._ready_s = self.setup.gpu.timestamp()  # the host's work is done; waits start here
        self.timeline.synchronize()  # the computation's input has arrived: timing starts now
        self._start_s, energy = self.meter.read()
        self.profiler.on_counter(self._start_s, energy)
        self._start_marker = self.timeline.record_marker()

    def after_computation(self, kind: str, clock: int | None) -> None:
        self._end_marker = self.timeline.record_marker()  # reached when its work is done
        self.timeline.synchronize()
        end, energy = self.meter.read()
        if clock is not None:
            start_s, end_s = self._device_span(end)
            self.profiler.on_computation(kind, clock, start_s, end_s, ready=min(self._ready_s, start_s))
        self.profiler.on_counter(end, energy)

    def _device_span(self, host_end_s: float) -> tuple[float, float]:
        """The computation's start and end on the device (host times where a marker has none)."""
        start = self._start_marker.device_time_s() if self._start_marker is not None else None
        end = self._end_marker.device_time_s() if self._end_marker is not None else None
        start = self._start_s if start is None else min(max(start, self._start_s), host_end_s)
        end = host_end_s if end is None else min(max(end, start), host_end_s)
        return start, end

    def end_iteration(self, fallback_reason: str | None) -> None:
        profiler = self.profiler
        if profiler.done or fallback_reason is not None:
            profiler.stop(fallback_reason or profiler.stop_reason)
        else:
            self.iterations += 1
            profiler.end_iteration()

    def measurements(self, fell_back: bool) -> StageMeasurements | None:
        """This rank's rows. A rank that fell back cannot vouch for the clocks it was asked to
        run; its default clock (the maximum) is real, so the planner keeps that stage there."""
        clocks = self.setup.candidate_clocks[:1] if fell_back else None
        # Read once profiling has synchronised (every marker reached); unreached: not counted.
        # The job's first iteration is no guide (allocations, first launches): without a later
        # one, the profiling gaps count whole.
        trace = self.free_running if self.free_running is not None and self.free_running.iteration > 0 else None
        start_s = trace.start.device_time_s() if trace is not None and trace.start is not None else None
        spans = trace.device_spans() if start_s is not None else None
        if spans:
            self.profiler.on_free_running_iteration(start_s, [(start, end) for start, end, _ in spans])
        self.free_running = None
        try:
            measured = self.profiler.measurements(clocks)
        except Exception as err:  # this stage's gap is reported by the pipeline leader
            level = logging.WARNING if fell_back else logging.ERROR
            fix = "" if fell_back or not isinstance(err, MeasurementError) else (
                f"; the energy counter needs more time per clock: raise {PREFIX}.profiling_iterations_per_clock, "
                f"or set {PREFIX}.blocking_power_w (one unknown less)")
            logger.log(level, "perseus-ext: stage %d: profiling produced no usable data (%s)%s",
                       self.profiler.stage, err, fix)
            return None
        self.overhead_s = measured.overhead_s
        return measured

    def finish_iteration(self, comm: ControlPlane, fallback_reason: str | None, *, blocking_override_w: float | None,
                         gpu_name: str | None, save: Callable[[MeasuredProfile], None]) -> tuple[bool, MeasuredProfile | None]:
        """Every rank, at the end of each profiling iteration (collectives): (False, None) while
        some rank still profiles; then (True, the pipeline's profile on its leader -- None on
        the other ranks or when it is unusable). `save` keeps pipeline 0's profile."""
        self.end_iteration(fallback_reason)
        (all_done,) = comm.all_min([float(self.profiler.done)])
        if not all_done:
            return False, None
        measurements = self.measurements(fallback_reason is not None)
        (iterations,) = comm.all_max([self.iterations])
        # One line per stage (pipeline 0's ranks); the other pipelines' at DEBUG.
        logger.log(logging.INFO if comm.pipeline == 0 else logging.DEBUG,
                   "perseus-ext: profiling finished after %d iteration(s) (stage %d: %s; framework "
                   "overhead %.2f ms per computation)", int(iterations), self.profiler.stage,
                   self.profiler.stop_reason, 1000 * self.overhead_s)
        gathered = comm.gather_pipeline(measurements)
        if not comm.is_pipeline_leader:
            return True, None
        try:
            measured = self.assemble(gathered, pipeline=comm.pipeline, blocking_override_w=blocking_override_w,
                                     gpu_name=gpu_name)
            if measured is not None and comm.pipeline == 0:
                save(measured)
        except Exception as err:  # leader-only work: failing it must not skip a collective
            logger.exception("perseus-ext: pipeline %d: assembling the profile failed: %r", comm.pipeline, err)
            return True, None
        return True, measured

    @property
    def waits_s(self) -> float:
        """Median device wait for an input per computation while profiling (not overhead)."""
        waits = self.profiler.waits_s
        return statistics.median(waits) if waits else 0.0

    @staticmethod
    def assemble(gathered: list[tuple[Member, StageMeasurements | None]], *, pipeline: int,
                 blocking_override_w: float | None, gpu_name: str | None) -> MeasuredProfile | None:
        """One pipeline's profile from its ranks' measurements: tensor-parallel peers of a stage
        add up their energy and blocking power, the slowest peer sets the time."""
        by_stage: dict[int, list[StageMeasurements]] = {}
        for member, measured in gathered:
            if measured is None:
                logger.warning("perseus-ext: rank %d (stage %d) has no profile; pipeline %d stays at "
                               "default clocks", member.rank, member.stage, pipeline)
                return None
            by_stage.setdefault(member.stage, []).append(measured)
        peers_per_stage = {len(peers) for peers in by_stage.values()}
        if len(peers_per_stage) != 1:
            logger.error("perseus-ext: pipeline %d has stages with different GPU counts %s",
                         pipeline, sorted(peers_per_stage))
            return None
        gpus_per_stage = peers_per_stage.pop()
        by_stage = _fill_in_overhead(by_stage, pipeline)
        rows = []
        for stage, peers in sorted(by_stage.items()):
            indexed = [{(r.instruction, r.frequency): r for r in p.rows} for p in peers]
            for key in sorted(set.intersection(*(set(rows_of) for rows_of in indexed))):
                matches = [rows_of[key] for rows_of in indexed]
                rows.append({"stage": stage, "instruction": key[0], "frequency": key[1],
                             "time": max(r.time for r in matches), "energy": sum(r.energy for r in matches)})
        per_stage_w = (blocking_override_w * gpus_per_stage if blocking_override_w is not None
                       else gpus_per_stage * _blocking_power_per_gpu_w(by_stage, pipeline))
        try:
            profile = Profile.from_rows(rows, source=f"online profile of pipeline {pipeline}")
        except PerseusError as err:
            logger.error("perseus-ext: pipeline %d profile is unusable: %s", pipeline, err)
            return None
        return MeasuredProfile(profile, per_stage_w, gpus_per_stage, gpu_name)


def _blocking_power_per_gpu_w(by_stage: dict[int, list[StageMeasurements]], pipeline: int) -> float:
    """One GPU's blocking power: the mean of the GPUs' estimates that came out positive.

    A GPU's fit can fail to tell its idle power from its busy power (windows whose idle time
    moves with the computations' time) and comes out at or below 0 W, clipped to 0: no GPU
    waits at 0 W, so such an estimate says nothing, and averaging it in would pull the
    pipeline's figure down. With no positive estimate the figure is 0 W: this run plans as if
    waiting were free (clocks filtered on energy alone), and the profile store does not save a
    profile without a blocking power (`ProfileStore.save`), so the next run profiles again."""
    estimates = [m.blocking_power_w for peers in by_stage.values() for m in peers]
    known = [w for w in estimates if w > 0]
    if len(known) < len(estimates):
        logger.warning(
            "perseus-ext: pipeline %d: %d of %d GPU(s) could not estimate the blocking power from their "
            "profiling windows (the fit came out at or below 0 W)%s; set %s.blocking_power_w to the GPUs' "
            "power while they wait", pipeline, len(estimates) - len(known), len(estimates),
            "; the others' mean is used" if known else "; this run plans as if waiting were free", PREFIX)
    return statistics.fmean(known) if known else 0.0


def _fill_in_overhead(by_stage: dict[int, list[StageMeasurements]], pipeline: int) -> dict[int, list[StageMeasurements]]:
    """Stages whose every gap may hold a pipeline wait (e.g. middle stages, or stage 0 with one
    microbatch) get the smallest framework overhead measured on the pipeline's other stages."""
    known = [m.overhead_s for peers in by_stage.values() for m in peers if m.overhead_measured]
    if not known or all(m.overhead_measured for peers in by_stage.values() for m in peers):
        return by_stage
    overhead = min(known)
    logger.info("perseus-ext: pipeline %d: stages %s have no gap free of pipeline waits; they get the "
                "smallest framework overhead measured elsewhere, %.2f ms per computation", pipeline,
                sorted(s for s, peers in by_stage.items() if not all(m.overhead_measured for m in peers)),
                1000 * overhead)

    def filled(m: StageMeasurements) -> StageMeasurements:
        if m.overhead_measured:
            return m
        rows = tuple(dataclasses.replace(r, time=r.time + overhead, energy=r.energy + overhead * m.blocking_power_w)
                     for r in m.rows)
        return dataclasses.replace(m, rows=rows, overhead_s=overhead, overhead_measured=True)

    return {stage: [filled(m) for m in peers] for stage, peers in by_stage.items()}
