"""One run of a recurring job under the batch-size optimizer: what the runtime drives on rank 0.

The life of a run::

    job = RecurringJob.start(store, "nightly-gpt", [32, 64, 128], 64, max_power_w=400,
                             num_gpus=64, target=TargetMetric("val_loss", 2.1, higher_is_better=False))
    batch_size = job.decision.batch_size            # before the engine is built; broadcast it
    ...
    if job.record_iteration(energy_j=job_energy_of_this_iteration):   # every iteration
        ...restore clocks at this iteration boundary, then stop (all ranks)...
        job.raise_if_stopped()                      # PerseusEarlyStop, for scripts to catch
    if job.report_metric(val_loss):                 # every evaluation: True once reached
        ...the target is reached; the run is already recorded...
    job.finish()                                    # at the end: "not reached" unless it was

Time counts on `clock` from `start()` (the job's start: warm-up, profiling, solving and
evaluations included) to the target; energy is the sum of what `record_iteration` is handed
(every GPU of the job). A heartbeat thread renews the run's lease while the process lives, so
a run that crashes (no `finish`) expires from the store after `lease_s`; a Python exception
leaving a ``with job:`` block expires it at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from perseus_ext.background import start_background
from perseus_ext.errors import ConfigError, PerseusError
from perseus_ext.policies.batch_size import (
    DEFAULT_LEASE_S,
    BatchSizeOptimizer,
    RunOutcome,
    Suggestion,
)
from perseus_ext.policies.bso_store import DEFAULT_NETWORK_TIMEOUT_S, Store

logger = logging.getLogger(__name__)

#: Heartbeats per lease: a run survives this many lost heartbeats minus one.
HEARTBEATS_PER_LEASE = 4


@dataclass(frozen=True)
class TargetMetric:
    """The job's target: `name` reaching `value` (from above if lower is better)."""

    name: str
    value: float
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"target metric name must be a non-empty string, got {self.name!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ConfigError(f"target metric {self.name!r} value must be a finite number, got {self.value!r}")

    def is_reached(self, value: float) -> bool:
        return value >= self.value if self.higher_is_better else value <= self.value


@dataclass(frozen=True)
class BatchSizeDecision:
    """What this run uses. Rank 0 gets it from the store; every rank must use `batch_size`."""

    run_id: int
    job_id: str
    batch_size: int
    cost_limit: float | None  # the run stops once its cost passes this; None: no limit yet
    phase: str  # "prune" or "thompson"


@dataclass(frozen=True)
class FinishedRun:
    """A finished run as the store records it: how it ended, its time, energy and cost."""

    run_id: int
    batch_size: int
    outcome: RunOutcome
    time_s: float
    energy_j: float
    cost: float
    cost_limit: float | None


class PerseusEarlyStop(PerseusError):
    """The run's cost passed its cost limit (beta x the best run so far). Raised at an
    iteration boundary, after clocks were restored: catch it to save a checkpoint and exit
    cleanly; the run is recorded as stopped."""

    def __init__(self, run_id: int, batch_size: int, cost: float, cost_limit: float):
        super().__init__(
            f"run {run_id} (batch size {batch_size}) stopped early: its cost {cost:.4g} passed "
            f"the cost limit {cost_limit:.4g} (beta x the cheapest run so far)"
        )
        self.run_id = run_id
        self.batch_size = batch_size
        self.cost = cost
        self.cost_limit = cost_limit


class RecurringJob:
    """One run of a recurring job: its batch size, cost accounting, early stop and report."""

    def __init__(
        self,
        optimizer: BatchSizeOptimizer,
        suggestion: Suggestion,
        *,
        num_gpus: int,
        target: TargetMetric | None = None,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: bool = True,
    ):
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise ConfigError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        self.optimizer = optimizer
        self.decision = BatchSizeDecision(
            suggestion.run_id,
            suggestion.job_id,
            suggestion.batch_size,
            suggestion.cost_limit,
            suggestion.phase,
        )
        self.num_gpus = num_gpus
        self.target = target
        self.clock = clock
        self.started_at = clock()
        self.energy_j = 0.0
        self.stopped = False
        self.report: FinishedRun | None = None
        self._frozen: tuple[float, float] | None = None  # time, energy at the stop or target
        self._weights = optimizer.cost.weights()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat:
            self._thread = start_background(threading.Thread(
                target=self._heartbeat, args=(suggestion.lease_s / HEARTBEATS_PER_LEASE,),
                name="perseus-bso-heartbeat", daemon=True,
            ))

    @classmethod
    def start(
        cls,
        store: str | Path | Store,
        job_id: str,
        batch_sizes: Sequence[int],
        default_batch_size: int,
        *,
        max_power_w: float,
        num_gpus: int,
        target: TargetMetric | None = None,
        eta: float = 0.5,
        beta: float = 2.0,
        pruning_rounds: int = 2,
        seed: int | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        network_timeout_s: float = DEFAULT_NETWORK_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> "RecurringJob":
        """Ask the store for this run's batch size (call on rank 0, before the engine is built)."""
        optimizer = BatchSizeOptimizer(
            store, job_id, batch_sizes, default_batch_size, eta=eta, max_power_w=max_power_w,
            beta=beta, pruning_rounds=pruning_rounds, seed=seed, lease_s=lease_s, network_timeout_s=network_timeout_s,
        )
        return cls.with_optimizer(optimizer, num_gpus=num_gpus, target=target, clock=clock)

    @classmethod
    def with_optimizer(
        cls,
        optimizer: BatchSizeOptimizer,
        *,
        num_gpus: int,
        target: TargetMetric | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> "RecurringJob":
        """`start` with the optimizer built already (from a config section: `policies.factories`)."""
        job = cls(optimizer, optimizer.suggest(), num_gpus=num_gpus, target=target, clock=clock)
        logger.info(
            "batch-size optimizer: run %d of job %r uses batch size %d (%s; cost limit %s)",
            job.decision.run_id, job.decision.job_id, job.decision.batch_size, job.decision.phase,
            "none yet" if job.decision.cost_limit is None else f"{job.decision.cost_limit:.4g}",
        )
        return job

    # ---------------------------------------------------------------- accounting
    @property
    def elapsed_s(self) -> float:
        """Seconds since the job's start (frozen at the early stop or the target)."""
        return self._frozen[0] if self._frozen else self.clock() - self.started_at

    @property
    def cost(self) -> float:
        energy = self._frozen[1] if self._frozen else self.energy_j
        return self._weights.cost(self.elapsed_s, energy, self.num_gpus)

    def record_iteration(self, energy_j: float) -> bool:
        """Add one iteration's energy (all GPUs of the job). True once the run's cost passed
        its cost limit: stop at this iteration boundary. Stays True; no-op after the end."""
        if self._frozen is not None:
            return self.stopped
        if isinstance(energy_j, bool) or not isinstance(energy_j, (int, float)) or not 0 <= energy_j < math.inf:
            raise ConfigError(f"energy_j must be a finite number of joules >= 0, got {energy_j!r}")
        self.energy_j += float(energy_j)
        limit = self.decision.cost_limit
        if limit is not None and self.cost > limit:
            self._frozen = (self.clock() - self.started_at, self.energy_j)
            self.stopped = True
            logger.warning("%s", self._early_stop())
        return self.stopped

    def _early_stop(self) -> PerseusEarlyStop:
        assert self.decision.cost_limit is not None
        return PerseusEarlyStop(
            self.decision.run_id, self.decision.batch_size, self.cost, self.decision.cost_limit
        )

    def raise_if_stopped(self) -> None:
        """Raise PerseusEarlyStop if the cost limit was passed (after recording the run)."""
        if self.stopped:
            self.finish()
            raise self._early_stop()

    def report_metric(self, value: float) -> bool:
        """Hand over one evaluation result. True once the target is reached: the run is then
        recorded as reached, with the time and energy up to now."""
        if self.target is None:
            raise ConfigError(
                "report_metric needs a target: set perseus.policy.batch_size.target_metric "
                "(name, value, higher_is_better) or pass TargetMetric to RecurringJob.start"
            )
        if self.report is not None:
            return self.report.outcome is RunOutcome.REACHED
        if self.stopped or not self.target.is_reached(float(value)):
            return False
        self._frozen = (self.clock() - self.started_at, self.energy_j)
        self.finish(RunOutcome.REACHED)
        return True

    # ------------------------------------------------------------------ the end
    def finish(self, outcome: RunOutcome | None = None) -> FinishedRun:
        """Record how the run ended (idempotent): stopped if it passed its cost limit, else
        `outcome`, by default not reached (a run that ends without reaching its target)."""
        if self.report is not None:
            return self.report
        if outcome is None:
            outcome = RunOutcome.STOPPED if self.stopped else RunOutcome.NOT_REACHED
        if self._frozen is None:
            self._frozen = (self.clock() - self.started_at, self.energy_j)
        time_s, energy_j = self._frozen
        self._stop_heartbeat()
        cost = self.optimizer.report(
            self.decision.run_id, time_s, energy_j, num_gpus=self.num_gpus, outcome=outcome
        )
        self.report = FinishedRun(
            self.decision.run_id, self.decision.batch_size, RunOutcome(outcome), time_s,
            energy_j, cost, self.decision.cost_limit,
        )
        logger.info(
            "batch-size optimizer: run %d (batch size %d) %s after %.1f s, %.4g J, cost %.4g",
            self.decision.run_id, self.decision.batch_size, self.report.outcome.value, time_s,
            energy_j, cost,
        )
        return self.report

    def abandon(self) -> None:
        """The run is failing: expire it now rather than after its lease (counts for nothing)."""
        self._stop_heartbeat()
        if self.report is None:
            self.optimizer.abandon(self.decision.run_id)

    def close(self) -> None:
        self._stop_heartbeat()
        self.optimizer.close()

    def __enter__(self) -> "RecurringJob":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """A normal end or an early stop is recorded; any other exception expires the run."""
        try:
            if exc_type is None or issubclass(exc_type, PerseusEarlyStop):
                self.finish()
            else:
                self.abandon()
        finally:
            self.close()

    def _heartbeat(self, interval_s: float) -> None:
        while not self._done.wait(interval_s):
            try:
                self.optimizer.heartbeat(self.decision.run_id)
            except PerseusError as err:  # an unreachable store must not take training down
                logger.warning("batch-size store heartbeat failed (%s); retrying", err)

    def _stop_heartbeat(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
