"""A real 2-rank DeepSpeed pipeline job that may not set clocks itself saves energy through zeusd.

Each rank's simulated GPU is unprivileged (like a non-root trainer's NVML): its clock and
power-limit writes go to the stand-in zeusd on a Unix socket (`zeusd_standin.py`, zeusd's
documented API), which changes the simulated hardware state the ranks then run at. zeusd numbers
the GPUs the other way round from the ranks, so a rank-indexed mapping would throttle the wrong
GPU."""

from __future__ import annotations

import importlib.util

import pytest

from zeusd_standin import ZeusdStandin, reader_spec, socket_in, standin_gpus

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency"),
    pytest.mark.slow, pytest.mark.distributed,
]
WORKLOAD = {"forward_seconds": [0.025, 0.035], "backward_seconds": [0.050, 0.070]}  # as tests/test_deepspeed.py
SAVING_FLOOR = 0.7  # the measured saving is at least this share of the model's (tests/test_deepspeed.py)
DEVICE_TIME_TOLERANCE = 0.02  # device-measured compute time of the plan vs its twin's


def test_non_root_deepspeed_job_sets_clocks_through_zeusd_and_saves_energy(tmp_path, monkeypatch):
    from perseus_ext import demo

    state = tmp_path / "gpus"
    state.mkdir()
    daemon = ZeusdStandin(standin_gpus(state, 2, order=[1, 0]), socket_path=socket_in(tmp_path)).start()
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(daemon.socket_path))
    monkeypatch.delenv("ZEUSD_TOKEN", raising=False)
    try:
        scenario = demo.Scenario(
            out_dir=str(tmp_path / "job"), stages=2, pipelines=1, iterations=36, straggler_pipeline=None,
            variants=["observe", "perseus"], **WORKLOAD,
            perseus={"gpu": reader_spec(state), "straggler_check_interval": 4, "clock_stride": 12},
        )
        results = demo.launch(scenario, timeout_s=480)
    finally:
        daemon.stop()

    perseus = demo.by_variant(results, "perseus")
    assert len(perseus) == scenario.world_size
    for rank in perseus:
        summary = rank["summary"]
        assert not summary["dry_run"] and summary["final_phase"] == "deployed", summary["fallback_reason"]
        zeusd = summary["zeusd"]
        assert zeusd["gpu_id"] == 1 - rank["rank"]  # found by PCI bus id, not by rank
        assert zeusd["writes"] > 0 and zeusd["failures"] == 0 and zeusd["control_fault"] is None
        assert rank["clocks_restored"]
    writes = daemon.writes()
    assert {w.query["gpu_ids"] for w in writes} == {"0", "1"}
    assert all(w.query["block"] == "true" for w in writes)
    assert any(w.path == "/gpu/set_gpu_locked_clocks" and w.query["min_clock_mhz"] != "1410" for w in writes)
    assert daemon.locked_clock(0) is None and daemon.locked_clock(1) is None  # restored through zeusd at exit

    comparison = demo.compare(scenario, results)
    window = comparison["windows"]["no straggler"]
    assert window["iterations"][1] - window["iterations"][0] >= 8
    model = perseus[0]["summary"]["frontier"]["intrinsic_saving"]  # what the model predicts for this job
    assert window["measured_energy_saving"] >= SAVING_FLOOR * model, (window, model)  # the runtime's, device-aligned
    assert window["energy_saving"] >= SAVING_FLOOR * model, (window, model)  # the simulated GPUs' exact energy
    # The planned time equals all-max-clock; on the devices (markers, not the crowded host's wall
    # clock) the plan's compute time equals the observing twin's.
    observe = demo.by_variant(results, "observe")
    kept = [i for i in range(*window["iterations"]) if all(r["iterations"][i]["plan"] is not None for r in perseus)]
    assert kept
    ours = sum(max(r["iterations"][i]["compute_s"] for r in perseus) for i in kept)
    twin = sum(max(r["iterations"][i]["compute_s"] for r in observe) for i in kept)
    assert abs(ours / twin - 1.0) <= DEVICE_TIME_TOLERANCE, (ours, twin)
    check = comparison["model_check"]
    assert check is not None and check["within_tolerance"], check
