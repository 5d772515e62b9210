"""Clock changes through zeusd, against a stand-in that follows zeusd's documented API on a real
Unix socket and on a loopback TCP port (`zeusd_standin.py`): the GPU mapping, the writes, the
token scopes, `block=false`, the daemon's error responses, every fault, strict mode, the runtime
when the daemon hangs or dies mid-run, and a SIGTERMed or SIGKILLed trainer restored through the daemon."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu import NVMLRestoreSpec, ZeusdRestoreSpec, gpu_switch_latency, open_gpu
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.measurement.gpu.common import StrictControlError
from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
from perseus_ext.measurement.gpu.zeusd_client import ZeusdAuthError, ZeusdClient, ZeusdEndpoint, ZeusdError
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime, Phase
from runtime_helpers import free_port, make_config, train
from zeusd_standin import ZeusdStandin, reader_spec, socket_in, standin_gpus

KEY = b"test-signing-key-of-thirty-two-b"


@pytest.fixture(params=["uds", "tcp"])
def zeusd(request, tmp_path, monkeypatch):
    """A stand-in zeusd serving the GPUs of ranks 1 and 0 (zeusd index 0 is rank 1's GPU, so a
    mapping by rank would write the wrong GPU), its variables exported like a job's."""
    daemon = _daemon(tmp_path, tcp=request.param == "tcp")
    for name, value in daemon.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ZEUSD_TOKEN", raising=False)
    yield daemon
    daemon.stop()


def _daemon(tmp_path: Path, *, tcp: bool = False, order: list[int] | None = None, **options) -> ZeusdStandin:
    return ZeusdStandin(standin_gpus(tmp_path, 2, order=[1, 0] if order is None else order),
                        socket_path=None if tcp else socket_in(tmp_path), tcp=tcp, **options).start()


def _gpu(tmp_path: Path, rank: int = 0, **options: str):
    return open_gpu(reader_spec(tmp_path, pace="0", **options), rank=rank)


# --------------------------------------------------------------------------- the path itself
def test_non_root_rank_writes_its_own_gpu_through_zeusd(zeusd, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="perseus_ext")
    gpu = _gpu(tmp_path, rank=0)
    assert isinstance(gpu, ZeusdGPU) and gpu.can_set_clocks()
    assert gpu.gpu_id == 1  # rank 0's GPU (PCI bus 01) is zeusd's GPU 1 here, not "index = rank"
    chosen = [r.message for r in caplog.records if "go through zeusd" in r.message]
    assert len(chosen) == 1 and r"may not set clocks itself" in chosen[0]
    assert not any("HTTP Request" in r.message for r in caplog.records)  # httpx's per-request INFO is muted

    gpu.set_locked_sm_clocks(1200)
    gpu.set_power_limit_w(300)
    gpu.reset_locked_sm_clocks()
    writes = zeusd.writes()
    assert [(w.path, w.query) for w in writes] == [
        ("/gpu/set_gpu_locked_clocks", {"gpu_ids": "1", "min_clock_mhz": "1200", "max_clock_mhz": "1200",
                                        "block": "true"}),
        ("/gpu/set_power_limit", {"gpu_ids": "1", "power_limit_mw": "300000", "block": "true"}),
        ("/gpu/reset_gpu_locked_clocks", {"gpu_ids": "1", "block": "true"}),
    ]
    # The simulated GPU only changed because the daemon changed its state (the rank may not).
    assert gpu.reader.clock_history == [1200, None]
    assert gpu.power_limit_w() == 300
    report = gpu.report()
    assert report.writes == 3 and report.failures == 0 and report.round_trip_ms_median > 0
    # Planned switching latency = the GPU's own + the daemon's measured round trip.
    latency = gpu_switch_latency(gpu)
    direct = gpu_switch_latency(gpu.reader)
    assert latency.issue_to_change_s == pytest.approx(direct.issue_to_change_s + gpu.round_trip_s)
    assert latency.switch_s == direct.switch_s  # from the call's return, as without zeusd
    assert 0 < gpu.round_trip_s < 0.5
    gpu.close()


def test_zeusd_0_5_without_pci_addresses_maps_by_nvml_index(tmp_path, monkeypatch):
    daemon = _daemon(tmp_path, order=[0, 1], version="0.5")
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(daemon.socket_path))
    try:
        assert _gpu(tmp_path, rank=1).gpu_id == 1
    finally:
        daemon.stop()


def test_explicit_zeusd_spec_and_the_root_process(zeusd, tmp_path, monkeypatch):
    # A process that may set clocks itself keeps its own path, whatever the variables say.
    assert isinstance(open_gpu("sim:a100_sxm?pace=0"), SimulatedGPU)
    explicit = open_gpu(f"zeusd:{reader_spec(tmp_path, pace='0', privileged='1')}", rank=1)
    assert isinstance(explicit, ZeusdGPU) and explicit.gpu_id == 0
    for name in ("ZEUSD_SOCK_PATH", "ZEUSD_HOST_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="neither ZEUSD_SOCK_PATH nor ZEUSD_HOST_PORT is set"):
        open_gpu("zeusd")
    assert str(make_config(gpu="zeusd", simulated_workload=None).gpu) == "zeusd"  # the key (and --perseus-gpu)
    assert str(make_config(gpu="zeusd:sim:a100_sxm").gpu) == "zeusd:sim:a100_sxm"
    with pytest.raises(ConfigError, match="perseus.gpu"):
        make_config(gpu="zeusd:cuda", simulated_workload=None)
    monkeypatch.setenv("ZEUSD_HOST_PORT", "localhost")
    with pytest.raises(ConfigError, match="must be host:port"):
        open_gpu("zeusd")


# --------------------------------------------------------------------------- the API as documented
def test_daemon_error_responses_reach_the_caller_as_one_clear_line(zeusd, tmp_path):
    client = ZeusdClient(ZeusdEndpoint.from_env(), None)
    with pytest.raises(ZeusdError, match="HTTP 400: GPU 1: NVML error: Invalid Argument"):
        client.write("set_gpu_locked_clocks", 1, "lock", min_clock_mhz=1201, max_clock_mhz=1201)
    with pytest.raises(ZeusdError, match="HTTP 400: GPU index 7 does not exist"):
        client.write("reset_gpu_locked_clocks", 7, "reset")
    with pytest.raises(ZeusdError, match="unknown field `mhz`"):
        client.write("reset_gpu_locked_clocks", 0, "reset", mhz=1)
    with pytest.raises(ZeusdError, match="missing field `max_clock_mhz`"):
        client.write("set_gpu_locked_clocks", 0, "lock", min_clock_mhz=1200)
    assert client.stats.failures == 4 and client.stats.writes == 0
    client.close()


def test_block_false_is_only_queued_and_reports_no_execution_error(zeusd, tmp_path):
    client = ZeusdClient(ZeusdEndpoint.from_env(), None)
    client.write("set_gpu_locked_clocks", 0, "lock", block=False, min_clock_mhz=1201, max_clock_mhz=1201)
    client.write("set_gpu_locked_clocks", 0, "lock", block=False, min_clock_mhz=990, max_clock_mhz=990)
    deadline = time.monotonic() + 5
    while zeusd.locked_clock(0) != 990 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert zeusd.locked_clock(0) == 990
    assert zeusd.async_errors == ["NVML error: Invalid Argument"]  # only the daemon saw it
    assert client.stats.failures == 0
    client.close()


def test_tokens_scopes_and_disabled_groups(tmp_path, monkeypatch):
    daemon = _daemon(tmp_path, signing_key=KEY)
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(daemon.socket_path))
    try:
        monkeypatch.delenv("ZEUSD_TOKEN", raising=False)
        assert "ZEUSD_TOKEN is not set" in _gpu(tmp_path).control_help()
        monkeypatch.setenv("ZEUSD_TOKEN", daemon.token("alice", ["gpu-read"]))
        fault = _gpu(tmp_path).control_help()
        assert "user 'alice' has scopes [gpu-read], not 'gpu-control'" in fault and "zeusd token issue" in fault
        monkeypatch.setenv("ZEUSD_TOKEN", daemon.token("alice", ["gpu-control"], expires_in_s=-60))
        assert "HTTP 401: Token has expired." in _gpu(tmp_path).control_help()
        monkeypatch.setenv("ZEUSD_TOKEN", "not-a-jwt")
        fault = _gpu(tmp_path).control_help()
        assert "HTTP 401" in fault and "scope 'gpu-control'" in fault and "zeusd token issue" in fault

        # A write refused for its scope (a token changed behind a running job) names the fix too.
        reader = SimulatedGPU("a100_sxm", pace=False, privileged=False)
        endpoint = ZeusdEndpoint.from_env()
        refused = ZeusdGPU(reader, endpoint, token=daemon.token("bob", ["gpu-read"]), gpu_id=0)
        with pytest.raises(ZeusdAuthError, match=r"HTTP 403: Token for user 'bob' lacks required scope "
                                                 r"'gpu-control'.*zeusd token issue"):
            refused.set_locked_sm_clocks(1200)

        monkeypatch.setenv("ZEUSD_TOKEN", daemon.token("alice", ["gpu-read", "gpu-control"], expires_in_s=3600))
        gpu = _gpu(tmp_path)
        assert gpu.can_set_clocks()
        gpu.set_locked_sm_clocks(1200)
        assert daemon.writes()[-1].user == "alice"
    finally:
        daemon.stop()

    read_only = _daemon(tmp_path, enabled=("gpu-read", "cpu-read"))
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(read_only.socket_path))
    try:
        fault = _gpu(tmp_path).control_help()
        assert "started without the 'gpu-control' API group" in fault and "--enable gpu-control" in fault
        direct = ZeusdGPU(SimulatedGPU("a100_sxm", pace=False), ZeusdEndpoint.from_env(), gpu_id=0)
        with pytest.raises(ZeusdError, match="HTTP 404: API group 'gpu-control' is not enabled"):
            direct.reset_locked_sm_clocks()
    finally:
        read_only.stop()


# --------------------------------------------------------------------------- faults at start-up
def _startup_faults(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """Each way zeusd can be unusable when the job starts, and the words its message must hold."""
    faults = {}
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(tmp_path / "missing.sock"))
    faults["no socket"] = ("no socket at", _gpu(tmp_path))
    crashed = _daemon(tmp_path)
    crashed.kill()  # its socket file stays behind, nobody listens
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(crashed.socket_path))
    faults["stale socket"] = ("connection refused", _gpu(tmp_path))
    monkeypatch.delenv("ZEUSD_SOCK_PATH")
    monkeypatch.setenv("ZEUSD_HOST_PORT", f"127.0.0.1:{free_port()}")
    faults["tcp refused"] = ("connection refused", _gpu(tmp_path))
    hung = _daemon(tmp_path, tcp=True)
    hung.hang()
    monkeypatch.setenv("ZEUSD_HOST_PORT", hung.env["ZEUSD_HOST_PORT"])
    started = time.monotonic()
    faults["hung"] = ("did not answer within 2 s", _gpu(tmp_path))
    assert time.monotonic() - started < 5  # bounded by the read timeout
    hung.stop()
    return faults


@pytest.mark.distributed
def test_every_startup_fault_is_a_clear_dry_run_or_a_strict_config_error(tmp_path, monkeypatch, caplog):
    for name, (words, gpu) in _startup_faults(tmp_path, monkeypatch).items():
        assert isinstance(gpu, ZeusdGPU) and not gpu.can_set_clocks(), name
        assert words in gpu.control_help(), (name, gpu.control_help())
        with pytest.raises(StrictControlError, match="strict mode") as raised:
            FrequencyController(gpu, strict=True, watchdog=False)
        assert isinstance(raised.value, ConfigError) and words in str(raised.value)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            controller = FrequencyController(gpu, watchdog=False, handle_signals=False)
        assert controller.dry_run and words in caplog.text, name
        controller.close()


def test_strict_runtime_stops_at_start_up_with_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(tmp_path / "missing.sock"))
    with pytest.raises(ConfigError, match="no socket at .*missing.sock"):
        PerseusRuntime(make_config(strict=True), schedule=build_schedule("1f1b", 1, 4), stage=0,
                       gpu=_gpu(tmp_path, period="0.02"))


# --------------------------------------------------------------------------- faults mid-run
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["hangs", "dies"])
def test_daemon_failing_mid_run_never_stops_training(fault, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("perseus_ext.measurement.gpu.zeusd_client.READ_TIMEOUT_S", 0.5)  # a shorter hang
    daemon = _daemon(tmp_path)
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(daemon.socket_path))
    gpu = open_gpu(reader_spec(tmp_path, period="0.02"), rank=0)
    runtime = PerseusRuntime(make_config(), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    try:
        train(runtime, 20)
        assert runtime.phase is Phase.DEPLOYED and daemon.writes() and not runtime.controller.dry_run
        daemon.hang() if fault == "hangs" else daemon.kill()
        started = time.monotonic()
        runtime.controller.set_clock(1200)  # a change due now (the deployed plan may hold one clock)
        assert time.monotonic() - started < 0.1  # the training thread never waits for the daemon
        assert runtime.controller.flush(timeout=15)  # the test waits for the worker to try
        train(runtime, 10)
        assert runtime.controller.error_count >= 1 and runtime.controller.disabled_reason is not None
    finally:
        caplog.set_level(logging.WARNING)
        runtime.close()
        daemon.release()
    summary = runtime.summary()
    assert summary["iterations"] == 30
    assert summary["zeusd"]["failures"] >= 1 and summary["zeusd"]["writes"] >= 1
    words = "did not answer within 0.5 s" if fault == "hangs" else "connection refused"
    assert words in summary["zeusd"]["last_error"]
    assert "clock change(s) through zeusd" in caplog.text and words in caplog.text
    if fault == "hangs":  # the daemon answers again: the watchdog finishes the restore through it
        deadline = time.monotonic() + 20
        while daemon.locked_clock(1) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon.locked_clock(1) is None
    daemon.stop()


# --------------------------------------------------------------------------- SIGTERM, SIGKILL
TRAINER = textwrap.dedent("""
    import sys, time
    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.measurement.gpu import open_gpu
    gpu = open_gpu(sys.argv[1], rank=0)
    controller = FrequencyController(gpu)
    controller.set_clock(1200)
    controller.flush(10)
    print("locked", gpu.gpu_id, flush=True)
    time.sleep(60)
""")


@pytest.mark.distributed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_trainer_is_restored_through_zeusd(signum, zeusd, tmp_path):
    """SIGTERM: the trainer's own handler restores; SIGKILL: its watchdog does; both through zeusd."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, reader_spec(tmp_path, pace="0")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().split() == ["locked", "1"], trainer.stderr.read() if trainer.poll() else ""
        assert zeusd.locked_clock(1) == 1200
        trainer.send_signal(signum)
        trainer.wait(10)
        deadline = time.monotonic() + 20
        while zeusd.locked_clock(1) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert zeusd.locked_clock(1) is None
        assert zeusd.writes()[-1].path == "/gpu/reset_gpu_locked_clocks"
        assert zeusd.writes()[-1].query["gpu_ids"] == "1"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.communicate()


# --------------------------------------------------------------------------- a real GPU's reader, doctor, flags
def test_nvml_gpu_is_found_among_zeusds_gpus_by_pci_bus_id(zeusd, monkeypatch):
    """The NVML backend resolves the CUDA device (here by UUID) and zeusd's GPU is the one at its PCI
    bus id: zeusd index 1, although the device is NVML index 0 (what zeusd <= 0.5 would use)."""
    from test_cli_doctor import FakeNVMLWithDriver
    from test_gpu_nvml import FakeDevice

    devices = [FakeDevice("GPU-bbbb", "00000000:01:00.0"), FakeDevice("GPU-aaaa", "00000000:81:00.0")]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithDriver(devices))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: False)
    gpu = open_gpu("nvml")
    assert isinstance(gpu, ZeusdGPU) and gpu.gpu_id == 1 and gpu.uuid == "GPU-bbbb"
    gpu.set_locked_sm_clocks(1200)
    gpu.reset_locked_sm_clocks()
    assert [w.query["gpu_ids"] for w in zeusd.writes()] == ["1", "1"]
    assert devices[0].calls == []  # NVML itself was never asked to change anything
    assert gpu.energy_mj() > 0  # reads stay on NVML
    assert gpu.restore_spec() == ZeusdRestoreSpec(gpu_id=1, reader=NVMLRestoreSpec(uuid="GPU-bbbb"),
                                                  socket_path=zeusd.env.get("ZEUSD_SOCK_PATH"),
                                                  host_port=zeusd.env.get("ZEUSD_HOST_PORT"))


def test_doctor_says_which_path_can_set_clocks_and_why(zeusd, tmp_path, monkeypatch, capsys):
    from perseus_ext.cli import main
    from test_cli_doctor import FakeNVMLWithDriver
    from test_gpu_nvml import FakeDevice

    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithDriver([FakeDevice("GPU-bbbb", "00000000:01:00.0")]))
    privileged = {"value": False}
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: privileged["value"])
    doctor = ["doctor", "--gpu", "sim:a100_sxm?pace=0&period=0.02", "--updates", "2"]
    assert main(doctor) == 0
    assert "clock control path: zeusd: zeusd at" in capsys.readouterr().out
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(tmp_path / "missing.sock"))
    monkeypatch.delenv("ZEUSD_HOST_PORT", raising=False)
    main(doctor)
    printed = capsys.readouterr().out
    assert "clock control path: none: zeusd at" in printed and "no socket at" in printed and "dry-run" in printed
    privileged["value"] = True
    main(doctor)
    assert "clock control path: root: this process holds CAP_SYS_ADMIN" in capsys.readouterr().out


def test_megatron_flag_takes_zeusd():
    import argparse

    from perseus_ext.adapters.megatron_args import add_perseus_args, config_from_args

    args = add_perseus_args(argparse.ArgumentParser()).parse_args(["--perseus", "--perseus-gpu", "zeusd"])
    assert str(config_from_args(args).gpu) == "zeusd"
