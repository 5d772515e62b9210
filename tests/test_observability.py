"""The observability room: one row model for the JSONL log that the runtime writes and `perseus-ext
report` reads (the file format unchanged), the rank's feed the metrics writers read instead of
the runtime, and a room that loads without the runtime."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.inputs import InputError, validate_json_line
from perseus_ext.observability.feed import MAX_UNREAD, RankFeed, RankIdentity
from perseus_ext.observability.iteration import IterationRecord, IterationSetting
from perseus_ext.observability.log_files import read_logs
from perseus_ext.observability.log_row import LogRow
from perseus_ext.observability.monitoring import IterationMetrics
from perseus_ext.observability.phase import Phase
from perseus_ext.observability.saving_estimate import Comparison, Moments
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime

from runtime_helpers import make_config, sim_gpu, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _record(iteration: int = 7, **setting: object) -> IterationRecord:
    fields = {"plan": 2, "factor": 1.1, **setting}
    return IterationRecord(IterationSetting(iteration, Phase.DEPLOYED, **fields), rank=3, pipeline=1, stage=0,
                           time_s=0.5, compute_s=0.4, energy_j=120.0, coverage=0.97, wall_time=1.7e9,
                           clock_mhz=1250.0)


def test_a_row_is_written_byte_for_byte_as_logs_always_were():
    """The oracle is the row as the writer used to build it: a literal dict in the file's key
    order, encoded with json.dumps' defaults."""
    record = _record()
    setting = record.setting
    old_writer = json.dumps({
        "timestamp": record.wall_time, "job": "abc", "iteration": record.iteration, "rank": record.rank,
        "pipeline": record.pipeline, "stage": record.stage, "phase": setting.phase.value,
        "setting": setting.describe(), "plan": setting.plan,
        "profiled_clock_mhz": setting.profiled_clock_mhz, "power_limit_w": setting.power_limit_w,
        "factor": setting.factor, "fell_back": setting.fell_back, "probe": setting.probe,
        "time_s": record.time_s,
        "compute_s": record.compute_s, "energy_j": record.energy_j, "coverage": record.coverage,
    })
    assert LogRow.of_record(record, "abc").to_json_line() == old_writer


def test_a_row_of_an_older_log_still_reads(tmp_path):
    """Rows written before they named their job, rank place or setting read with those fields None."""
    log = tmp_path / "old.jsonl"
    log.write_text("".join(json.dumps({"iteration": k, "rank": 0, "phase": "deployed", "time_s": 0.5,
                                       "energy_j": 100.0, "plan": 0}) + "\n" for k in range(3)))
    row = validate_json_line(LogRow, log.read_text().splitlines()[0], path=log, line=1, fix="x")
    assert (row.job, row.timestamp, row.pipeline, row.stage, row.setting) == (None, None, None, None, None)
    runs = read_logs([log]).runs
    assert len(runs) == 1 and [sample.iteration for sample in runs[0].samples()] == [0, 1, 2]


def test_the_rows_phases_are_the_runtimes_and_a_stranger_is_refused_by_name(tmp_path):
    for phase in Phase:
        line = json.dumps({"iteration": 0, "rank": 0, "phase": phase.value, "time_s": 1.0})
        assert validate_json_line(LogRow, line, path="x", line=1, fix="x").phase == phase.value
    bad = json.dumps({"iteration": 0, "rank": 0, "phase": "resting", "time_s": 1.0})
    with pytest.raises(InputError) as caught:
        validate_json_line(LogRow, bad, path=tmp_path / "log.jsonl", line=4, fix="give the runtime's logs")
    assert str(caught.value).startswith(f"{tmp_path / 'log.jsonl'}:4: phase: ") and "'resting'" in str(caught.value)


finite = st.floats(min_value=0.0, max_value=1e5, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(iteration=st.integers(0, 1 << 40), phase=st.sampled_from(list(Phase)), time_s=finite,
       energy_j=st.none() | finite, coverage=st.none() | st.floats(0.0, 1.0), probe=st.booleans(),
       fell_back=st.booleans(), plan=st.none() | st.integers(0, 500), job=st.none() | st.text(max_size=16))
def test_what_the_runtime_writes_the_report_reads_back_unchanged(iteration, phase, time_s, energy_j, coverage, probe,
                                                                  fell_back, plan, job):
    setting = IterationSetting(iteration, phase, plan=plan, factor=1.0 if plan is not None else None,
                               fell_back=fell_back, probe=probe)
    record = IterationRecord(setting, rank=5, pipeline=2, stage=1, time_s=time_s, compute_s=time_s,
                             energy_j=energy_j, coverage=coverage, wall_time=1.7e9)
    written = LogRow.of_record(record, job)
    read = validate_json_line(LogRow, written.to_json_line(), path="x", line=1, fix="x")
    assert read == written


def _comparison() -> Comparison:
    default = (Moments.of([100.0, 102.0, 98.0]), Moments.of([1.0, 1.0, 1.0]))
    deployed = (Moments.of([80.0, 81.0, 79.0, 80.0]), Moments.of([1.05, 1.05, 1.04, 1.06]))
    comparison = Comparison.of(default, deployed)
    assert comparison is not None
    return comparison


def test_the_metrics_writer_needs_only_the_feed():
    """IterationMetrics on a feed built by hand (no runtime): every record's scalars, the clock
    and power it carries, and the saving as it stood when the records were taken."""
    saving = _comparison()
    feed = RankFeed(RankIdentity("job", rank=0, local_rank=0, pipeline=0, stage=0), None, lambda: saving)
    written: list[tuple[str, float, int]] = []
    metrics = IterationMetrics(feed, [written.extend])
    metrics.write()
    assert written == []  # nothing published yet
    feed.publish(_record(7))
    feed.publish(_record(8, plan=None, factor=None, probe=True))
    metrics.write()
    by_name = {(name, step): value for name, value, step in written}
    assert by_name["perseus/clock_mhz", 7] == 1250.0
    assert by_name["perseus/power_w", 8] == pytest.approx(120.0 / 0.5)
    assert by_name["perseus/plan", 7] == 2 and by_name["perseus/plan", 8] == -1
    assert by_name["perseus/baseline_probe", 8] == 1.0
    assert by_name["perseus/saving", 8] == pytest.approx(saving.saving)
    assert ("perseus/saving", 7) not in by_name  # once per batch, at its last step
    written.clear()
    feed.publish(_record(9))
    feed.close()  # the rank's close: the writer writes what came last
    assert {step for _, _, step in written} == {9}


def test_a_feed_nobody_reads_stays_bounded():
    feed = RankFeed(RankIdentity("job", 0, 0, 0, 0), None, lambda: None)
    for iteration in range(MAX_UNREAD + 10):
        feed.publish(_record(iteration))
    batch = feed.take()
    assert len(batch.records) == MAX_UNREAD and batch.records[0].iteration == 10
    assert feed.take().records == ()


def test_a_failing_close_hook_does_not_stop_the_others():
    feed = RankFeed(RankIdentity("job", 0, 0, 0, 0), None, lambda: None)
    ran = []
    feed.on_close(lambda: 1 / 0)
    feed.on_close(lambda: ran.append(True))
    feed.close()
    assert ran == [True]


def test_the_runtime_publishes_each_record_with_its_planned_clock(tmp_path):
    """The planned clock a deployed record carries is the mean of the deployed plan's clocks for
    the stage, read from the deployment (the oracle) rather than from the sequencer's trace the
    recorder uses; default-clock iterations carry the GPU's highest clock."""
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(baseline_fraction=0.25, straggler_check_interval=4,
                                         log_path=str(tmp_path / "log-{rank}.jsonl")),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    published: list[IterationRecord] = []
    runtime.parts.feed.on_close(lambda: published.extend(runtime.parts.feed.take().records))
    train(runtime, 30)
    runtime.close()
    assert [r.iteration for r in published] == [r.iteration for r in runtime.history]
    deployed = [r for r in published if r.setting.plan is not None]
    assert deployed, "no deployed iteration in 30"
    for record in deployed:
        clocks = runtime.deployment.stage_clocks(0, record.setting.plan)
        assert record.clock_mhz == pytest.approx(sum(clocks) / len(clocks))
    top = float(gpu.supported_sm_clocks()[0])
    assert all(r.clock_mhz == top for r in published if r.phase.at_default_clocks)
    rows = [json.loads(line) for line in (tmp_path / "log-0.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [r.iteration for r in runtime.history]
    assert all(math.isclose(row["energy_j"], r.energy_j) for row, r in zip(rows, runtime.history))


def test_the_report_loads_without_the_runtime():
    code = ("import sys, perseus_ext.observability.reporting, perseus_ext.observability.monitoring, "
            "perseus_ext.observability.prometheus; "
            "loaded = sorted(m for m in sys.modules if m.startswith('perseus_ext.runtime')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
