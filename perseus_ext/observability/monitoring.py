"""Per-iteration perseus metrics where users already look: DeepSpeed's monitor, Megatron's
TensorBoard and W&B writers.

Why: a training job's dashboards (TensorBoard, W&B, DeepSpeed's CSV monitor) are where people
watch a run; a JSONL file beside them is easily missed. The adapters call `IterationMetrics.write`
at every iteration end; it writes the device records that have arrived since (they come about
an iteration late) as scalars stepped by the iteration number:

* `perseus/energy_per_iteration_j`, `perseus/time_per_iteration_s`: this rank's GPU, as measured;
* `perseus/phase`: `PHASE_CODES` (warm-up 0 ... observing 5), `perseus/fell_back` and
  `perseus/baseline_probe` (0/1), `perseus/plan` (the frontier plan, -1 at default clocks) and
  `perseus/clock_coverage` (share of the plan's compute time at its planned clock);
* `perseus/power_w`: the iteration's average GPU power; `perseus/clock_mhz`: its planned SM
  clock (the profiled clock, the mean of the plan's clocks over the stage's computations, the
  max clock at default);
* `perseus/straggler_factor`: the slowdown the pipeline plans for (1 = fastest plan);
* `perseus/power_swing_w`, `perseus/power_max_ramp_w_per_s`: the iteration's peak-to-trough power
  and largest ramp (50 ms moving average) from 1 ms power samples, where the device gives them
  (simulated GPUs; NVML's default power reading cannot, docs/monitoring.md);
* `perseus/saving`, `perseus/saving_low`, `perseus/saving_high`: the energy saving measured
  against the baseline probes so far, with its 95 % interval.

The writer reads the rank's feed (`observability.feed.RankFeed`: typed records the runtime
publishes), never the runtime itself. The figures are the writing rank's (DeepSpeed's monitor
writes on global rank 0, Megatron's writers live on the last rank); the job's figure is rank 0's
line at close and `perseus-ext report`'s. DeepSpeed's monitor gets them stepped by samples, as
DeepSpeed steps its own (`Train/Samples/*`). The records still in flight at the end are written
when the rank records its last iterations at close. Every rank also feeds its Prometheus exporter
when `perseus.prometheus` (or its environment variable) asks for one
(`perseus_ext.observability.prometheus`). A failing writer is logged once and dropped: metrics
never break training.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from perseus_ext.background import start_background
from perseus_ext.observability.feed import RankFeed
from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.phase import Phase

logger = logging.getLogger(__name__)

PREFIX = "perseus/"
PHASE_CODES = {phase: code for code, phase in enumerate(Phase)}

Sink = Callable[[list[tuple[str, float, int]]], None]  # (name, value, step) events


def record_events(record: IterationRecord) -> list[tuple[str, float, int]]:
    """The scalars of one device record."""
    setting, step = record.setting, record.iteration
    values: dict[str, float | None] = {
        "energy_per_iteration_j": record.energy_j, "time_per_iteration_s": record.time_s,
        "power_w": record.power_w, "clock_mhz": record.clock_mhz,
        "phase": PHASE_CODES[setting.phase], "fell_back": float(setting.fell_back),
        "baseline_probe": float(setting.probe), "plan": -1 if setting.plan is None else setting.plan,
        "clock_coverage": record.coverage, "straggler_factor": setting.factor,
    }
    if record.power is not None:  # fine power samples (simulated devices): this iteration's swing
        swing = record.power.swing()
        values.update(power_swing_w=swing.peak_to_trough_w, power_max_ramp_w_per_s=swing.max_ramp_w_per_s)
    return [(PREFIX + name, float(value), step) for name, value in values.items() if value is not None]


def deepspeed_sink(monitor: Any, samples_at: Callable[[int], int] | None = None) -> Sink | None:
    """DeepSpeed's `engine.monitor` (TensorBoard, W&B, CSV, Comet as configured), when enabled;
    `samples_at(iteration)` gives the engine's sample count after that iteration, the step
    DeepSpeed's own scalars use."""
    if monitor is None or not getattr(monitor, "enabled", False):
        return None
    if samples_at is None:
        return monitor.write_events

    def write(events: list[tuple[str, float, int]]) -> None:
        monitor.write_events([(name, value, samples_at(step)) for name, value, step in events])
    return write


class SampleCounts:
    """Iteration -> the engine's `global_samples` after it, as the adapter saw them; records
    arrive about an iteration late, so only the last `KEPT` are kept (weeks of training stay
    bounded). An iteration no longer or not yet known is counted at the batch size."""

    KEPT = 1024

    def __init__(self, batch_size: Callable[[], int]) -> None:
        self._batch_size = batch_size
        self._samples: dict[int, int] = {}

    def record(self, iteration: int, samples: int) -> None:
        self._samples[iteration] = samples
        if len(self._samples) > self.KEPT:
            del self._samples[next(iter(self._samples))]

    def __call__(self, iteration: int) -> int:
        known = self._samples.get(iteration)
        return known if known is not None else (iteration + 1) * self._batch_size()


def tensorboard_sink(writer: Any) -> Sink:
    """A `torch.utils.tensorboard.SummaryWriter` (Megatron's `get_tensorboard_writer()`)."""
    def write(events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            writer.add_scalar(name, value, step)
    return write


def wandb_sink(writer: Any) -> Sink:
    """A W&B run or module (Megatron's `get_wandb_writer()`): one `log` call per step."""
    def write(events: list[tuple[str, float, int]]) -> None:
        steps: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            steps.setdefault(step, {})[name] = value
        for step, values in sorted(steps.items()):
            writer.log(values, step=step)
    return write


def megatron_sinks(tensorboard_writer: Any = None, wandb_writer: Any = None) -> list[Sink]:
    """The writers given, else Megatron-LM's global ones (`megatron.training.global_vars`,
    absent with megatron-core alone, and None on ranks without a writer)."""
    if tensorboard_writer is None and wandb_writer is None:
        try:
            from megatron.training import global_vars
        except ImportError:
            return []
        tensorboard_writer = global_vars.get_tensorboard_writer()
        wandb_writer = global_vars.get_wandb_writer()
    sinks = [tensorboard_sink(tensorboard_writer)] if tensorboard_writer is not None else []
    if wandb_writer is not None:
        sinks.append(wandb_sink(wandb_writer))
    return sinks


class IterationMetrics:
    """Writes each new device record of a rank's feed (`RankFeed`, which the runtime publishes)
    to the sinks, and to this rank's Prometheus exporter when one is configured; closes with the
    feed, so the last records reach every sink when the rank has recorded them."""

    def __init__(self, feed: RankFeed, sinks: Iterable[Sink | None]) -> None:
        self.feed = feed
        self.sinks = [sink for sink in sinks if sink is not None]
        self.exporter = _prometheus_exporter(feed)
        if self.exporter is not None:
            self.sinks.append(self.exporter)
        feed.on_close(self.close)

    def write(self) -> None:
        """Called by the adapters at every iteration end; never raises."""
        if not self.sinks:
            return
        batch = self.feed.take()
        if not batch.records:
            return
        events: list[tuple[str, float, int]] = []
        for record in batch.records:
            events += record_events(record)
        estimate = batch.saving
        if estimate is not None:
            step = batch.records[-1].iteration
            events += [(PREFIX + name, float(value), step) for name, value in (
                ("saving", estimate.saving), ("saving_low", estimate.saving_low),
                ("saving_high", estimate.saving_high)) if value is not None]
        for sink in list(self.sinks):
            try:
                sink(events)
            except Exception as err:  # a dashboard must never break training
                logger.error("perseus-ext: writing metrics failed (%r); this writer gets no more", err)
                self.sinks.remove(sink)

    def close(self) -> None:
        """The records the device finished last, then the exporter's last push; never raises.

        Called when the rank has recorded its last iteration, before it restores the clocks and
        gathers the job's summary: the push (seconds against a gateway that does not answer)
        runs on a thread of its own so neither waits for it, and the thread is not a daemon, so
        the process does not exit before the job's final figures are pushed."""
        self.write()
        if self.exporter is not None:
            start_background(threading.Thread(target=self._close_exporter, name="perseus-prometheus-close",
                                              daemon=False))

    def _close_exporter(self) -> None:
        try:
            self.exporter.close()
        except Exception:
            logger.exception("perseus-ext: closing the Prometheus exporter failed")


def _prometheus_exporter(feed: RankFeed) -> Any:
    """This rank's exporter (perseus.prometheus or its environment variable), else None."""
    from perseus_ext.observability.prometheus import PrometheusExporter, RankLabels, export_target

    identity = feed.identity
    target = export_target(feed.prometheus, identity.local_rank)
    if target is None:
        return None
    labels = RankLabels(target.job or identity.job_id, identity.rank, identity.stage, identity.pipeline)
    return PrometheusExporter(target, labels)
