"""`RecurringJob`: one run of a recurring job as the runtime drives it on rank 0 (batch size
from the store, cost from the job's start, target metric, early stop, crash expiry)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from perseus_ext.errors import ConfigError
from perseus_ext.policies.batch_size import BatchSizeOptimizer, RunOutcome, read_states
from perseus_ext.policies.recurring_job import (
    PerseusEarlyStop,
    RecurringJob,
    TargetMetric,
)

SIZES = [32, 64, 128]
MAX_POWER_W = 300.0  # eta 0.5: cost = 0.5 J + 0.5 x 300 W x GPUs x s
LOSS = TargetMetric("val_loss", 2.0, higher_is_better=False)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def start(path: Path, clock: FakeClock, **kwargs) -> RecurringJob:
    options = {"num_gpus": 2, "target": LOSS, "clock": clock, "pruning_rounds": 1, **kwargs}
    return RecurringJob.start(path, "job", SIZES, 64, max_power_w=MAX_POWER_W, **options)


def train(job: RecurringJob, clock: FakeClock, iterations: int, losses: list[float]) -> bool:
    """Iterations of 10 s and 1 kJ each, one evaluation after each; True if stopped early."""
    for iteration in range(iterations):
        clock.now += 10.0
        if job.record_iteration(energy_j=1000.0):
            return True
        if iteration < len(losses) and job.report_metric(losses[iteration]):
            return False
    return False


def test_a_run_that_reaches_its_target_reports_time_and_energy_from_the_start(tmp_path: Path) -> None:
    clock = FakeClock()
    job = start(tmp_path / "bso.db", clock)
    assert job.decision.batch_size == 64 and job.decision.cost_limit is None
    clock.now += 5.0  # building the engine, profiling: counted
    assert not train(job, clock, 10, [3.0, 2.5, 1.9])
    report = job.finish()  # idempotent after the target
    assert report.outcome is RunOutcome.REACHED
    assert report.time_s == 35.0 and report.energy_j == 3000.0
    assert report.cost == pytest.approx(0.5 * 3000.0 + 0.5 * MAX_POWER_W * 2 * 35.0)
    assert job.report_metric(5.0)  # stays reached
    job.close()
    (state,) = read_states(tmp_path / "bso.db")
    assert state.arms[64].reached == 1 and state.best_cost == pytest.approx(report.cost)


def test_a_run_past_its_cost_limit_stops_cleanly_and_is_recorded_as_stopped(tmp_path: Path) -> None:
    clock = FakeClock()
    with start(tmp_path / "bso.db", clock) as first:
        train(first, clock, 3, [3.0, 2.5, 1.9])  # cost 10,500
    second = start(tmp_path / "bso.db", clock)
    assert second.decision.batch_size == 32 and second.decision.cost_limit == pytest.approx(21_000.0)
    stopped_at = None
    for iteration in range(20):
        clock.now += 10.0
        if second.record_iteration(1000.0):
            stopped_at = iteration
            break
    # Each iteration costs 500 + 3000 = 3500: 7 iterations cost 24,500 > 21,000 (6 cost 21,000).
    assert stopped_at == 6 and second.stopped
    assert second.record_iteration(1000.0)  # stays stopped, adds nothing
    with pytest.raises(PerseusEarlyStop) as err:
        second.raise_if_stopped()
    assert err.value.run_id == second.decision.run_id and err.value.batch_size == 32
    assert err.value.cost == pytest.approx(24_500.0) and err.value.cost_limit == pytest.approx(21_000.0)
    assert second.report is not None and second.report.outcome is RunOutcome.STOPPED
    assert second.report.energy_j == 7000.0 and second.report.time_s == 70.0
    assert not second.report_metric(0.0)  # too late
    second.close()
    (state,) = read_states(tmp_path / "bso.db")
    assert state.arms[32].stopped == 1 and state.arms[32].pruned


def test_with_block_records_early_stop_and_expires_a_crash(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "bso.db"
    with start(path, clock) as job:
        train(job, clock, 2, [3.0, 1.0])
    with pytest.raises(PerseusEarlyStop):
        with start(path, clock) as job:
            while not job.record_iteration(1000.0):
                clock.now += 10.0
            job.raise_if_stopped()
    with pytest.raises(ZeroDivisionError):
        with start(path, clock) as job:
            crashed = job.decision
            raise ZeroDivisionError
    (state,) = read_states(path)
    arm = state.arms[crashed.batch_size]
    assert arm.expired == 1 and arm.running == 0 and not arm.costs
    assert state.arms[32].stopped == 1 and state.arms[64].reached == 1


def test_a_run_that_ends_without_its_target_is_not_reached(tmp_path: Path) -> None:
    clock = FakeClock()
    job = start(tmp_path / "bso.db", clock)
    train(job, clock, 3, [3.0, 2.9, 2.8])
    report = job.finish()
    assert report.outcome is RunOutcome.NOT_REACHED and report.time_s == 30.0
    job.close()
    (state,) = read_states(tmp_path / "bso.db")
    assert state.arms[64].not_reached == 1 and state.arms[64].pruned


def test_targets_and_inputs_are_checked(tmp_path: Path) -> None:
    assert TargetMetric("accuracy", 0.9).is_reached(0.91) and not TargetMetric("accuracy", 0.9).is_reached(0.5)
    with pytest.raises(ConfigError, match="finite number"):
        TargetMetric("loss", float("nan"))
    clock = FakeClock()
    job = start(tmp_path / "bso.db", clock, target=None)
    with pytest.raises(ConfigError, match="set perseus.policy.batch_size.target_metric"):
        job.report_metric(1.0)
    with pytest.raises(ConfigError, match="energy_j must be a finite number"):
        job.record_iteration(-1.0)
    job.abandon()
    job.close()


def _crashing_run(path: str, ready) -> None:  # noqa: ANN001 (a multiprocessing Event)
    RecurringJob.start(path, "job", SIZES, 64, max_power_w=MAX_POWER_W, num_gpus=1, lease_s=0.6)
    ready.set()
    time.sleep(60)  # killed before this ends


def test_heartbeats_keep_a_live_run_and_a_killed_one_expires(tmp_path: Path) -> None:
    path = tmp_path / "bso.db"
    live = RecurringJob.start(path, "job", SIZES, 64, max_power_w=MAX_POWER_W, num_gpus=1, lease_s=0.6)
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    crashing = context.Process(target=_crashing_run, args=(str(path), ready))
    crashing.start()
    assert ready.wait(30)
    os.kill(crashing.pid, signal.SIGKILL)
    crashing.join(10)
    time.sleep(1.5)  # well past the lease: only heartbeats keep a run alive
    state = BatchSizeOptimizer(path, "job", SIZES, 64, max_power_w=MAX_POWER_W).state()
    assert state.arms[64].running == 1  # the live run, renewed by its heartbeat thread
    assert state.arms[32].expired == 1  # the killed run (it got the next size)
    assert live.finish().outcome is RunOutcome.NOT_REACHED
    live.close()
