"""The read-only GPU probe, run against the simulator."""

from __future__ import annotations

import json

import pytest
import torch

from perseus_ext.measurement.probe import main


def test_probe_reports_counter_and_hook_on_the_simulator(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--gpu", "sim:a40?pace=0&period=0.05", "--updates", "5", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == results
    assert results["gpu"].startswith("NVIDIA A40")
    assert results["energy_counter"]["update_period_s"] == pytest.approx(0.05, abs=0.001)
    assert results["energy_counter"]["updates"] == 5
    assert results["set_clock_hook"]["median_us"] < 50
    assert results["cuda_events"]["available"] is torch.cuda.is_available()


def test_probe_reports_bad_spec_as_an_error(capsys):
    assert main(["--gpu", "sim:v100"]) == 1
    assert "unknown simulated preset 'v100'" in capsys.readouterr().err
