"""Fine power samples on their way out of a rank: the JSONL row carries them (and reads them
back), the monitors and Prometheus get each iteration's swing, computed by hand here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.inputs import validate_json_line
from perseus_ext.observability.iteration import IterationRecord, IterationSetting
from perseus_ext.observability.log_files import sample_of
from perseus_ext.observability.log_row import LogRow
from perseus_ext.observability.monitoring import record_events
from perseus_ext.observability.phase import Phase
from perseus_ext.observability.power_samples import PowerSamples
from perseus_ext.observability.prometheus import ExportTarget, PrometheusExporter, RankLabels

# one iteration: 100 ms at 90 W, 200 ms at 400 W, 100 ms at 250 W (1 ms samples)
WATTS = np.repeat([90.0, 400.0, 250.0], [100, 200, 100])


def _record(power: PowerSamples | None, probe: bool = False) -> IterationRecord:
    return IterationRecord(IterationSetting(9, Phase.DEPLOYED, plan=4, factor=1.0, probe=probe), rank=1, pipeline=0,
                           stage=1, time_s=0.4, compute_s=0.35, energy_j=float(WATTS.sum() / 1000), coverage=1.0,
                           wall_time=1.7e9, clock_mhz=1200.0, power=power)


def test_a_row_carries_the_samples_and_reads_them_back():
    samples = PowerSamples(0.001, 123_456_789, WATTS + 0.0004)  # below the row's milliwatt resolution
    line = LogRow.of_record(_record(samples), "job").to_json_line()
    raw = json.loads(line)
    assert raw["power_bin_s"] == 0.001 and raw["power_first_bin"] == 123_456_789
    assert raw["power_bins_w"][:2] == [90.0, 90.0] and len(raw["power_bins_w"]) == 400
    row = validate_json_line(LogRow, line, path="x", line=1, fix="x")
    back = row.power_samples()
    assert back.first_bin == samples.first_bin and back.watts == pytest.approx(WATTS, abs=1e-3)
    sample = sample_of(row)
    assert sample.plan == 4 and sample.iteration_power().samples.end_bin == 123_456_789 + 400
    probe = sample_of(validate_json_line(LogRow, LogRow.of_record(_record(samples, probe=True), "job").to_json_line(),
                                         path="x", line=1, fix="x"))
    assert probe.plan is None and probe.iteration_power().plan is None  # a probe runs no plan: it ends a run
    assert "power_bins_w" not in json.loads(LogRow.of_record(_record(None), "job").to_json_line())


def test_a_row_with_a_negative_sample_is_refused_by_name():
    line = LogRow.of_record(_record(PowerSamples(0.001, 0, WATTS)), "job").to_json_line().replace("[90.0,", "[-1.0,")
    with pytest.raises(Exception, match="power_bins_w"):
        validate_json_line(LogRow, line, path="x", line=1, fix="x")


def test_the_monitors_and_prometheus_get_the_iteration_s_swing():
    events = dict((name, value) for name, value, _ in record_events(_record(PowerSamples(0.001, 0, WATTS))))
    # by hand: 400 - 90 W; the largest step (90 -> 400 W, wrapping 250 -> 90 is smaller) over 50 ms
    assert events["perseus/power_swing_w"] == pytest.approx(310.0)
    assert events["perseus/power_max_ramp_w_per_s"] == pytest.approx(310.0 / 0.05)
    assert "perseus/power_swing_w" not in dict((n, v) for n, v, _ in record_events(_record(None)))
    exporter = PrometheusExporter(ExportTarget(None, "127.0.0.1", None, 15.0, None), RankLabels("j", 1, 1, 0))
    try:
        exporter(record_events(_record(PowerSamples(0.001, 0, WATTS))))
        labels = {"job": "j", "rank": "1", "stage": "1", "pipeline": "0"}
        assert exporter.registry.get_sample_value("perseus_power_swing_watts", labels) == pytest.approx(310.0)
        assert exporter.registry.get_sample_value("perseus_power_max_ramp_watts_per_second", labels) == \
            pytest.approx(6200.0)
    finally:
        exporter.close()


@settings(max_examples=60, deadline=None)
@given(first_bin=st.integers(-(1 << 40), 1 << 40),
       watts=st.lists(st.floats(0.0, 2000.0, allow_nan=False), min_size=1, max_size=300),
       period_s=st.sampled_from([0.001, 0.005, 0.01]))
def test_any_samples_survive_the_log_to_the_milliwatt(first_bin, watts, period_s):
    samples = PowerSamples(period_s, first_bin, np.array(watts))
    row = validate_json_line(LogRow, LogRow.of_record(_record(samples), "j").to_json_line(), path="x", line=1, fix="x")
    back = row.power_samples()
    assert (back.period_s, back.first_bin, len(back.watts)) == (period_s, first_bin, len(watts))
    assert np.abs(back.watts - np.array(watts)).max() <= 0.0005 + 1e-9
