"""perseus-ext's Prometheus export against the real thing: Debian's Prometheus server scrapes the
per-rank endpoints of a real 2-rank DeepSpeed pipeline job (one rank per stage) while it trains,
and a real Pushgateway receives every rank's pushes; the series are read back through
Prometheus's HTTP API and compared with the job's own JSONL logs."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.errors import ConfigError
from perseus_ext.observability.prometheus import export_target
from perseus_ext.config import PerseusConfig, PrometheusConfig

import prometheus_server

pytest.importorskip("prometheus_client", reason="prometheus-client is the optional 'prometheus' extra")

JOB = "prometheus-test"
ITERATIONS = 48
SUPPORTED_MAX_MHZ = 1410  # the simulated A100's max clock


def _logs(directory) -> dict[int, dict[int, dict]]:
    """rank -> iteration -> the JSONL row the rank logged."""
    rows: dict[int, dict[int, dict]] = {}
    for rank in (0, 1):
        for line in (directory / f"log-perseus-{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(rank, {})[row["iteration"]] = row
    return rows


def _samples(server, metric: str, rank: int) -> dict[float, float]:
    """Every scraped sample of one rank's series (timestamp -> value) over the last 10 minutes."""
    result = server.query(f'{metric}{{job="{JOB}",rank="{rank}",instance!=""}}[10m]')  # not the gateway's
    return {float(t): float(v) for series in result for t, v in series["values"]}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_real_prometheus_scrapes_a_deepspeed_job_and_a_pushgateway_keeps_its_end(tmp_path):
    pytest.importorskip("deepspeed")
    from perseus_ext import demo

    base_port = prometheus_server.free_ports(2)
    ranks_ports = range(base_port, base_port + 2)  # bound by the job's ranks later: no server may take them
    gateway_run = prometheus_server.start_pushgateway(tmp_path, reserved=ranks_ports)
    gateway = next(gateway_run)
    targets = [f"127.0.0.1:{base_port}", f"127.0.0.1:{base_port + 1}", gateway.address]
    server_run = prometheus_server.start_prometheus(tmp_path, targets, reserved=ranks_ports)
    server = next(server_run)
    try:
        job_dir = tmp_path / "job"
        scenario = demo.Scenario(
            out_dir=str(job_dir), stages=2, pipelines=1, microbatches=2, iterations=ITERATIONS,
            straggler_pipeline=None, variants=["perseus"],
            perseus={"baseline_fraction": 0.25, "log_interval": 0, "prometheus": {
                "port": base_port, "address": "127.0.0.1", "job": JOB,
                "pushgateway": gateway.url, "push_interval_s": 60}},  # only the final push, at close
        )
        demo.launch(scenario, timeout_s=480)
        logs = _logs(job_dir)
        output = (job_dir / "torchrun.log").read_text()
        # Lines every rank used to repeat come once (rank 0), per-stage ones once per stage.
        assert output.count(" ready on ") == 1 and output.count("profiling finished after") == 2, output[-3000:]
        assert "profiling done after" not in output and "serves Prometheus metrics" in output

        # --- scraped from the ranks' endpoints while the job ran
        up = server.query(f'up{{instance=~"127.0.0.1:({base_port}|{base_port + 1})"}}[10m]')
        assert len(up) == 2 and all(any(v == "1" for _, v in series["values"]) for series in up), up
        for rank in (0, 1):
            energy = _samples(server, "perseus_iteration_energy_joules", rank)
            iteration = _samples(server, "perseus_iteration", rank)
            time_s = _samples(server, "perseus_iteration_time_seconds", rank)
            power = _samples(server, "perseus_power_watts", rank)
            clock = _samples(server, "perseus_sm_clock_mhz", rank)
            assert len(energy) >= 3, f"rank {rank}: {len(energy)} scrapes"
            # One scrape = one timestamp for all of a target's series: each scraped energy is the
            # energy the rank logged for the iteration scraped with it.
            for at, joules in energy.items():
                logged = logs[rank][int(iteration[at])]
                assert joules == pytest.approx(logged["energy_j"], rel=1e-9)
                assert time_s[at] == pytest.approx(logged["time_s"], rel=1e-9)
                assert power[at] == pytest.approx(joules / time_s[at], rel=1e-9)
                assert 0 < clock[at] <= SUPPORTED_MAX_MHZ
            labels = server.query(  # the endpoint is gone: its series are stale, so look back
                f'last_over_time(perseus_phase{{job="{JOB}",rank="{rank}",instance="127.0.0.1:{base_port + rank}"}}[10m])')
            assert labels and labels[0]["metric"]["stage"] == str(rank) and labels[0]["metric"]["pipeline"] == "0"
            phases = {int(v) for v in _samples(server, "perseus_phase", rank).values()}
            assert 3 in phases, phases  # deployed iterations were scraped
            deployed = server.query(f'max_over_time(perseus_phase_info{{job="{JOB}",rank="{rank}",'
                                    f'perseus_phase_info="deployed"}}[10m])')
            assert deployed and float(deployed[0]["value"][1]) == 1.0

        # --- the final push: the Pushgateway holds each rank's last figures after the job ended
        for rank in (0, 1):
            # honor_labels: the gateway's series keep its empty `instance`, i.e. none
            pushed_iteration = server.wait_for(
                f'perseus_iteration{{job="{JOB}",rank="{rank}",instance=""}} == {ITERATIONS - 1}')
            assert pushed_iteration, f"rank {rank}: the last iteration never reached the Pushgateway"
            pushed = {s["metric"]["__name__"]: float(s["value"][1]) for s in server.query(
                f'{{job="{JOB}",rank="{rank}",instance="",__name__=~"perseus_.*"}}')}
            logged_total = sum(row["energy_j"] for row in logs[rank].values() if row["energy_j"] is not None)
            assert pushed["perseus_energy_joules_total"] == pytest.approx(logged_total, rel=1e-9)
            assert pushed["perseus_iterations_total"] == len(logs[rank]) == ITERATIONS
            assert pushed["perseus_phase"] == 3.0 and pushed["perseus_plan"] >= -1
            assert -1.0 < pushed["perseus_saving_ratio"] < 1.0  # measured from the baseline probes
            assert pushed["perseus_saving_low_ratio"] <= pushed["perseus_saving_ratio"] <= pushed["perseus_saving_high_ratio"]
            assert not math.isnan(pushed["perseus_clock_coverage_ratio"])
    finally:
        server_run.close()
        gateway_run.close()


def test_the_environment_turns_the_export_on_and_is_checked(monkeypatch):
    monkeypatch.delenv("PERSEUS_PROMETHEUS_PORT", raising=False)
    monkeypatch.delenv("PERSEUS_PUSHGATEWAY", raising=False)
    assert export_target(None, local_rank=0) is None
    monkeypatch.setenv("PERSEUS_PROMETHEUS_PORT", "9400")
    target = export_target(None, local_rank=3)
    assert target.port == 9403 and target.pushgateway is None
    section = PerseusConfig.from_dict({"prometheus": {"port": 9500}}).prometheus
    assert export_target(section, local_rank=1).port == 9501  # the section wins over the environment
    monkeypatch.setenv("PERSEUS_PROMETHEUS_PORT", "94o0")
    with pytest.raises(ConfigError, match="PERSEUS_PROMETHEUS_PORT='94o0' must be a TCP port"):
        export_target(None, local_rank=0)
    with pytest.raises(ConfigError, match="perseus.prometheus.port 65535 \\+ local rank 1 is past 65535"):
        export_target(PrometheusConfig.model_validate({"port": 65535}), local_rank=1)
    monkeypatch.delenv("PERSEUS_PROMETHEUS_PORT")
    with pytest.raises(ConfigError, match="perseus.prometheus exports nowhere"):
        PerseusConfig.from_dict({"prometheus": {"job": "x"}})
    assert "PERSEUS_PROMETHEUS_PORT" not in os.environ


@settings(max_examples=200, deadline=None, derandomize=True)
@given(port=st.text(max_size=12), gateway=st.text(max_size=40), local_rank=st.integers(0, 1023))
def test_any_environment_is_a_target_or_one_config_error(port, gateway, local_rank):
    """Whatever the job's environment holds: an export target, nothing, or a ConfigError naming
    the variable, never a traceback."""
    environment = {"PERSEUS_PROMETHEUS_PORT": port, "PERSEUS_PUSHGATEWAY": gateway}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            if "\0" in value:
                return  # the environment cannot hold it
            patch.setenv(name, value)
        try:
            target = export_target(None, local_rank=local_rank)
        except ConfigError as err:
            assert "PERSEUS_PROMETHEUS_PORT" in str(err) or "PERSEUS_PUSHGATEWAY" in str(err) \
                or "perseus.prometheus" in str(err)
            return
    if target is not None:
        assert target.port is None or 1 <= target.port <= 65535
        assert target.port is not None or target.pushgateway is not None
