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
  clock (the profiled clock, the plan's compute-time mean for this stage, the max clock at default);
* `perseus/straggler_factor`: the slowdown the pipeline plans for (1 = fastest plan);
* `perseus/saving`, `perseus/saving_low`, `perseus/saving_high`: the energy saving measured
  against the baseline probes so far, with its 95 % interval.

The figures are the writing rank's (DeepSpeed's monitor writes on global rank 0, Megatron's
writers live on the last rank); the job's figure is rank 0's line at close and `perseus-ext
report`'s. DeepSpeed's monitor gets them stepped by samples, as DeepSpeed steps its own
(`Train/Samples/*`). The records still in flight at the end are written when the runtime closes.
Every rank also feeds its Prometheus exporter when `perseus.prometheus` (or its environment
variable) asks for one (`perseus_ext.prometheus`). A failing writer is logged once and dropped:
metrics never break training.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from perseus_ext.runtime.phase import Phase
from perseus_ext.runtime.records import IterationRecord

logger = logging.getLogger(__name__)

PREFIX = "perseus/"
PHASE_CODES = {phase: code for code, phase in enumerate(Phase)}

Sink = Callable[[list[tuple[str, float, int]]], None]  # (name, value, step) events


def record_events(record: IterationRecord, clock_mhz: float | None = None) -> list[tuple[str, float, int]]:
    """The scalars of one device record (`clock_mhz`: its planned clock, when known)."""
    setting, step = record.setting, record.iteration
    power_w = record.energy_j / record.time_s if record.energy_j is not None and record.time_s > 0 else None
    values: dict[str, float | None] = {
        "energy_per_iteration_j": record.energy_j, "time_per_iteration_s": record.time_s,
        "power_w": power_w, "clock_mhz": clock_mhz,
        "phase": PHASE_CODES[setting.phase], "fell_back": float(setting.fell_back),
        "baseline_probe": float(setting.probe), "plan": -1 if setting.plan is None else setting.plan,
        "clock_coverage": record.coverage, "straggler_factor": setting.factor,
    }
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
    """Writes each new device record of `runtime` (a `PerseusRuntime`) to the sinks, and to
    this rank's Prometheus exporter when one is configured; registers `close` with the runtime,
    so the last records reach every sink when it closes."""

    def __init__(self, runtime: Any, sinks: Iterable[Sink | None]) -> None:
        self.runtime = runtime
        self.sinks = [sink for sink in sinks if sink is not None]
        self._written = 0  # records of runtime.history already written
        self._max_clock_mhz = _max_clock(runtime)
        self.exporter = _prometheus_exporter(runtime)
        if self.exporter is not None:
            self.sinks.append(self.exporter)
        on_close = getattr(runtime, "on_close", None)
        if on_close is not None:
            on_close(self.close)

    def write(self) -> None:
        """Called by the adapters at every iteration end; never raises."""
        history = self.runtime.history
        if not self.sinks or self._written >= len(history):
            return
        events: list[tuple[str, float, int]] = []
        for record in history[self._written:]:
            events += record_events(record, self._clock_mhz(record))
        self._written = len(history)
        estimate = self.runtime.probes.estimate()
        if estimate is not None:
            step = history[-1].iteration
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
        """The records the device finished last, then the exporter's last push; never raises."""
        self.write()
        if self.exporter is not None:
            try:
                self.exporter.close()
            except Exception:
                logger.exception("perseus-ext: closing the Prometheus exporter failed")

    def _clock_mhz(self, record: IterationRecord) -> float | None:
        setting = record.setting
        if setting.profiled_clock_mhz is not None:
            return float(setting.profiled_clock_mhz)
        deployment = getattr(self.runtime, "deployment", None)
        if setting.plan is not None and deployment is not None:
            try:
                clocks = deployment.stage_clocks(record.stage, setting.plan)
            except (IndexError, KeyError):  # a plan of a frontier since replaced
                return None
            return sum(clocks) / len(clocks) if clocks else None
        return self._max_clock_mhz  # default clocks


def _max_clock(runtime: Any) -> float | None:
    gpu = getattr(runtime, "gpu", None)
    try:
        return float(gpu.supported_sm_clocks()[0]) if gpu is not None else None
    except Exception:  # a GPU that cannot answer: no clock figure, training goes on
        return None


def _prometheus_exporter(runtime: Any) -> Any:
    """This rank's exporter (perseus.prometheus or its environment variable), else None."""
    from perseus_ext.prometheus import PrometheusExporter, RankLabels, export_target

    config = getattr(runtime, "config", None)
    target = export_target(getattr(config, "prometheus", None), getattr(runtime, "local_rank", 0))
    if target is None:
        return None
    comm = runtime.comm
    labels = RankLabels(target.job or runtime.job_id, comm.rank, runtime.stage, comm.pipeline)
    return PrometheusExporter(target, labels)
