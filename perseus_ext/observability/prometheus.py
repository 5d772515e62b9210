"""Per-rank perseus metrics for Prometheus: a /metrics endpoint per rank and/or a Pushgateway.

Why: a training cluster's power and energy are watched in Prometheus and Grafana; perseus-ext's
figures belong next to them, not only in DeepSpeed's monitor, Megatron's writers and JSONL.
The exporter is one more sink of `perseus_ext.observability.monitoring.IterationMetrics`, so it
exports exactly what the monitors get, per device record (energy, time, power, clock, phase, plan,
coverage, straggler factor, measured saving; the power swing where the device gives fine power
samples), as gauges labelled `job`, `rank`, `stage`, `pipeline`, plus running totals of energy and
iterations.

* `"prometheus": {"port": P}` (or env PERSEUS_PROMETHEUS_PORT=P): local rank r serves
  `http://<address>:P+r/metrics` from prometheus-client's own server thread, started when the
  runtime is built and stopped at close. Scrape them with `honor_labels: true`, so the `job`
  label is the training job's (otherwise Prometheus renames it `exported_job`).
* `"pushgateway": URL` (or env PERSEUS_PUSHGATEWAY): every rank pushes its registry, grouped by
  `job` and `rank`, every `push_interval_s` from a thread of its own and once more at close, so a
  job shorter than the scrape interval still leaves its figures.

Nothing here runs on the training thread but setting gauges (a few microseconds); an endpoint
that cannot bind or a gateway that does not answer is logged once and never breaks training.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from perseus_ext.errors import ConfigError
from perseus_ext.config.sections import PREFIX, PROMETHEUS_PORT_ENV, PUSHGATEWAY_ENV, PrometheusConfig
from perseus_ext.observability.phase import Phase

logger = logging.getLogger(__name__)

LABELS = ("job", "rank", "stage", "pipeline")
PUSH_TIMEOUT_S = 5.0
# The monitors' scalar (perseus/<name>) -> the Prometheus gauge and what it measures.
GAUGES: dict[str, tuple[str, str]] = {
    "energy_per_iteration_j": ("perseus_iteration_energy_joules", "GPU energy of the last recorded iteration"),
    "time_per_iteration_s": ("perseus_iteration_time_seconds", "device time of the last recorded iteration"),
    "power_w": ("perseus_power_watts", "average GPU power over the last recorded iteration"),
    "clock_mhz": ("perseus_sm_clock_mhz", "planned SM clock of the last recorded iteration (compute-time mean)"),
    "phase": ("perseus_phase", "lifecycle phase code (warm-up 0 ... observing 5; see perseus_phase_info)"),
    "plan": ("perseus_plan", "frontier plan index in force, -1 at default clocks"),
    "fell_back": ("perseus_fell_back", "1 when this rank fell back to default clocks"),
    "baseline_probe": ("perseus_baseline_probe", "1 when the iteration was a baseline probe at default clocks"),
    "clock_coverage": ("perseus_clock_coverage_ratio", "share of planned compute time at its planned clock"),
    "straggler_factor": ("perseus_straggler_factor", "slowdown the pipeline plans for (1 = fastest plan)"),
    "saving": ("perseus_saving_ratio", "energy saving measured against the baseline probes"),
    "saving_low": ("perseus_saving_low_ratio", "lower end of the saving's 95% interval"),
    "saving_high": ("perseus_saving_high_ratio", "upper end of the saving's 95% interval"),
    "power_swing_w": ("perseus_power_swing_watts", "peak-to-trough GPU power within the last recorded iteration, "
                      "from 1 ms samples (simulated GPUs only: docs/monitoring.md)"),
    "power_max_ramp_w_per_s": ("perseus_power_max_ramp_watts_per_second", "largest slope of the 50 ms moving "
                               "average of the GPU's power within the last recorded iteration (simulated GPUs only)"),
}


@dataclass(frozen=True)
class ExportTarget:
    """Where this rank's metrics go: a port to serve on and/or a gateway to push to."""

    port: int | None
    address: str
    pushgateway: str | None
    push_interval_s: float
    job: str | None


@dataclass(frozen=True)
class RankLabels:
    job: str
    rank: int
    stage: int
    pipeline: int

    def values(self) -> dict[str, str]:
        return {"job": self.job, "rank": str(self.rank), "stage": str(self.stage), "pipeline": str(self.pipeline)}


def export_target(config: PrometheusConfig | None, local_rank: int) -> ExportTarget | None:
    """The section's target, else the environment's (checked here: a ConfigError names the
    variable), else None (no export). The port is the base port plus the local rank."""
    port_text, gateway = os.environ.get(PROMETHEUS_PORT_ENV, "").strip(), os.environ.get(PUSHGATEWAY_ENV, "").strip()
    if config is None and not port_text and not gateway:
        return None
    section: dict[str, Any] = config.model_dump() if config is not None else {}
    if section.get("port") is None and port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ConfigError(f"env {PROMETHEUS_PORT_ENV}={port_text!r} must be a TCP port in [1, 65535], "
                              f"e.g. 9400 (local rank r serves on 9400 + r)")
        section["port"] = int(port_text)
    if section.get("pushgateway") is None and gateway:
        section["pushgateway"] = gateway
    try:
        config = PrometheusConfig.model_validate(section)
    except Exception as err:  # the env's gateway URL: the section's own keys passed the door
        raise ConfigError(f"env {PUSHGATEWAY_ENV}={gateway!r} is not a Pushgateway URL ({err})") from None
    port = None
    if config.port is not None:
        port = config.port + local_rank
        if port > 65535:
            raise ConfigError(f"{PREFIX}.prometheus.port {config.port} + local rank {local_rank} is past 65535; "
                              f"use a lower base port")
    return ExportTarget(port, config.address, config.pushgateway, config.push_interval_s, config.job)


class PrometheusExporter:
    """One rank's gauges in a registry of its own, served and/or pushed; a `Sink` of
    `IterationMetrics` (called with the monitors' events)."""

    def __init__(self, target: ExportTarget, labels: RankLabels) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise ConfigError(f"{PREFIX}.prometheus needs prometheus-client: pip install "
                              f"'perseus-ext[prometheus]'") from None
        self.target, self.labels = target, labels
        self._client = prometheus_client
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        # Children are made at the first value: a series shows up with the first record, never
        # as a 0 that was not measured.
        self._values = labels.values()
        self._gauges = {name: prometheus_client.Gauge(metric, doc, LABELS, registry=self.registry)
                        for name, (metric, doc) in GAUGES.items()}
        self._iteration = prometheus_client.Gauge(
            "perseus_iteration", "last iteration recorded from the device", LABELS, registry=self.registry)
        self._phase = prometheus_client.Enum(
            "perseus_phase_info", "lifecycle phase of the last recorded iteration", LABELS,
            states=[phase.value for phase in Phase], registry=self.registry)
        self._energy_total = prometheus_client.Counter(
            "perseus_energy_joules", "GPU energy of every recorded iteration", LABELS, registry=self.registry)
        self._iterations_total = prometheus_client.Counter(
            "perseus_iterations", "iterations recorded from the device", LABELS, registry=self.registry)
        self._phases = list(Phase)
        self._server: Any = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None
        self._push_failed = False
        if target.port is not None:
            try:
                self._server, _ = prometheus_client.start_http_server(target.port, target.address,
                                                                      registry=self.registry)
                logger.info("perseus-ext: rank %d serves Prometheus metrics on http://%s:%d/metrics",
                            labels.rank, target.address, target.port)
            except OSError as err:  # the port is taken: training goes on without the endpoint
                logger.error("perseus-ext: rank %d cannot serve Prometheus metrics on %s:%d (%s); no endpoint",
                             labels.rank, target.address, target.port, err)
        if target.pushgateway is not None:
            self._pusher = threading.Thread(target=self._push_periodically, name="perseus-pushgateway",
                                            daemon=True)
            self._pusher.start()

    def __call__(self, events: list[tuple[str, float, int]]) -> None:
        """The monitors' events, in recording order: the gauges take each scalar's latest value."""
        last_step = None
        values = self._values
        for name, value, step in events:
            short = name.removeprefix("perseus/")
            gauge = self._gauges.get(short)
            if gauge is not None:
                gauge.labels(**values).set(value)
            if short == "phase":
                self._phase.labels(**values).state(self._phases[int(value)].value)
            elif short == "energy_per_iteration_j":
                self._energy_total.labels(**values).inc(value)
            elif short == "time_per_iteration_s":  # one per record
                self._iterations_total.labels(**values).inc()
            last_step = step if last_step is None else max(last_step, step)
        if last_step is not None:
            self._iteration.labels(**values).set(last_step)

    def _push(self) -> None:
        try:
            self._client.push_to_gateway(
                self.target.pushgateway, job=self.labels.job, registry=self.registry,
                grouping_key={"rank": str(self.labels.rank)}, timeout=PUSH_TIMEOUT_S)
        except Exception as err:  # the gateway is down or refuses: never break training
            if not self._push_failed:
                logger.warning("perseus-ext: pushing metrics to %s failed (%r); will keep trying",
                               self.target.pushgateway, err)
            self._push_failed = True

    def _push_periodically(self) -> None:
        while not self._stop.wait(self.target.push_interval_s):
            self._push()

    def close(self) -> None:
        """The last push (the job's final figures), then the endpoint stops; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(PUSH_TIMEOUT_S + 1.0)
            self._push()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
