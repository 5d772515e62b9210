"""The read-only GPU probe, run against the simulator."""

from __future__ import annotations

import pytest
import torch

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.measurement.probe import cuda_event_timing, probe_gpu


def test_probe_reports_identity_and_counter_period_on_the_simulator():
    gpu = open_gpu("sim:a40?pace=0&period=0.05")
    try:
        results = probe_gpu(gpu, updates=5)
    finally:
        gpu.close()
    assert results["gpu"].startswith("NVIDIA A40")
    assert results["supported_sm_clocks"][0] > results["supported_sm_clocks"][1]
    assert results["energy_counter"]["update_period_s"] == pytest.approx(0.05, abs=0.001)
    assert results["energy_counter"]["updates"] == 5


def test_cuda_event_timing_says_why_it_is_unavailable():
    timing = cuda_event_timing(samples=2)
    assert timing["available"] is torch.cuda.is_available()
    if not timing["available"]:
        assert "CUDA" in timing["reason"]
