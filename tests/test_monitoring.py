"""Per-iteration perseus metrics arrive where users look: a TensorBoard event file (what
Megatron's writer produces) and DeepSpeed's CSV monitor, from a real pipeline job."""

from __future__ import annotations

import csv
import sys

import pytest

from perseus_ext.observability.monitoring import IterationMetrics, megatron_sinks, tensorboard_sink
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime

from runtime_helpers import make_config, sim_gpu, train  # noqa: E402


@pytest.mark.distributed
def test_metrics_reach_a_tensorboard_event_file(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard.SummaryWriter(log_dir=str(tmp_path))
    runtime = PerseusRuntime(make_config(baseline_fraction=0.5, straggler_check_interval=2),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    metrics = IterationMetrics(runtime.parts.feed, megatron_sinks(tensorboard_writer=writer))
    train(runtime, 40, after_iteration=metrics.write)
    runtime.close()
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"perseus/energy_per_iteration_j", "perseus/time_per_iteration_s", "perseus/phase", "perseus/plan",
            "perseus/baseline_probe", "perseus/straggler_factor", "perseus/clock_coverage",
            "perseus/saving", "perseus/saving_low"} <= tags
    phases = [e.value for e in events.Scalars("perseus/phase")]
    assert phases[0] == 0 and phases[-1] == 3  # warm-up ... deployed
    assert max(e.value for e in events.Scalars("perseus/baseline_probe")) == 1.0


def test_megatron_lms_global_writers_are_found(monkeypatch):
    """Under Megatron-LM (`megatron.training`, absent with megatron-core alone) the writers come
    from its global variables: None on ranks without one."""
    import types

    class Writer:
        def __init__(self):
            self.events = []

        def add_scalar(self, *event):
            self.events.append(event)

        def log(self, values, step):
            self.events.append((values, step))

    tensorboard, wandb = Writer(), Writer()
    global_vars = types.SimpleNamespace(get_tensorboard_writer=lambda: tensorboard, get_wandb_writer=lambda: wandb)
    training = types.ModuleType("megatron.training")
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    sinks = megatron_sinks()
    for sink in sinks:
        sink([("perseus/phase", 3.0, 7), ("perseus/plan", 0.0, 7)])
    assert tensorboard.events == [("perseus/phase", 3.0, 7), ("perseus/plan", 0.0, 7)]
    assert wandb.events == [({"perseus/phase": 3.0, "perseus/plan": 0.0}, 7)]
    global_vars.get_tensorboard_writer = global_vars.get_wandb_writer = lambda: None
    assert megatron_sinks() == []


def test_a_failing_writer_is_dropped_without_breaking_training():
    class Broken:
        def add_scalar(self, *args):
            raise OSError("disk full")

    runtime = PerseusRuntime(make_config(), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    metrics = IterationMetrics(runtime.parts.feed, [tensorboard_sink(Broken())])
    train(runtime, 4, after_iteration=metrics.write)
    runtime.close()
    assert metrics.sinks == [] and runtime.fallback_reason is None


@pytest.mark.distributed
def test_deepspeed_csv_monitor_gets_the_metrics_and_report_reproduces_the_demo(tmp_path):
    from perseus_ext import demo
    from perseus_ext.observability.reporting import analyse, read_logs

    scenario = demo.Scenario(
        out_dir=str(tmp_path), stages=2, pipelines=1, microbatches=2, iterations=64,
        forward_seconds=[0.010, 0.014], backward_seconds=[0.020, 0.028], straggler_pipeline=None,
        variants=["observe", "perseus"], perseus={"baseline_fraction": 0.25},
        deepspeed={"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}},
    )
    results = demo.launch(scenario, timeout_s=480)
    files = {path.name: path for path in (tmp_path / "csv").rglob("*.csv")}
    assert "perseus_energy_per_iteration_j.csv" in files and "perseus_saving.csv" in files, sorted(files)
    with open(files["perseus_phase.csv"]) as handle:
        rows = list(csv.reader(handle))
    phases = [float(row[1]) for row in rows if row[1] != "phase"]  # DeepSpeed repeats its header
    assert 3.0 in phases  # deployed iterations were written

    def steps(name: str) -> set[int]:
        with open(files[name]) as handle:
            return {int(row[0]) for row in csv.reader(handle) if row[0].isdigit()}

    # Stepped by samples like DeepSpeed's own scalars, every iteration up to the last one (its
    # record arrives after the last train_batch and is written at close): the same steps.
    samples_per_iteration = 4 * scenario.microbatches * scenario.pipelines
    assert steps("perseus_energy_per_iteration_j.csv") == steps("Train_Samples_train_loss.csv") == {
        samples_per_iteration * (iteration + 1) for iteration in range(scenario.iterations)}
    comparison = demo.compare(scenario, results)
    logs = sorted(tmp_path.glob("log-perseus-*.jsonl"))
    assert len(logs) == 2
    again = analyse(read_logs(logs), comparison["report"]["job"]["model_intrinsic_saving"])
    assert again["job"] == comparison["report"]["job"]  # `perseus-ext report` gives the demo's numbers
    assert again["job"]["measured"]["all"]["probes"] >= 3
