"""The job-wide side of a run: its batch size from the store, its time and energy, its early
stop and its report, and the one poller of an external signal (carbon, power budget).

Why a job-level collaborator: the batch-size optimizer prices a *run* (every GPU, from the
job's start to its target), and the store must see one answer per run, so rank 0 alone talks
to it. Before the engine is built, `choose_batch_size` asks the store on rank 0 and broadcasts
the answer (every rank must build the same engine); the `PreparedRun` it returns is handed to
the runtime by the adapter (`PerseusRuntime(prepared_run=...)`). Once the runtime exists, `JobCoordinator`
runs one small all-reduce per iteration boundary that carries, at once, this rank's energy since
the last boundary (summed: the job's energy), rank 0's stop decision, whether any rank saw the
target reached, and rank 0's reading of a shared signal (so one rank per job polls a carbon or
budget endpoint; the others hold an `ExternalSignal` fed with it). Rank 0's stop decision of one
boundary is acted on at the next, so every rank stops at the same iteration boundary.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from perseus_ext.errors import ConfigError
from perseus_ext.policies.batch_size import RunOutcome
from perseus_ext.policies.carbon import CarbonSignal, ExternalSignal, HTTPCarbonSignal
from perseus_ext.policies.chase import ChasePolicy
from perseus_ext.policies.factories import start_recurring_job, target_metric
from perseus_ext.config.policy import BudgetScope
from perseus_ext.policies.power_budget import PowerBudgetPolicy
from perseus_ext.policies.recurring_job import FinishedRun, PerseusEarlyStop, RecurringJob, TargetMetric
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.config import PREFIX, PerseusConfig

logger = logging.getLogger(__name__)

BATCH_SIZE_KEY = f"{PREFIX}.policy.batch_size"
NO_VALUE = -1.0  # a signal reading of "none yet" on the all-reduce (readings are >= 0)


@dataclass(frozen=True)
class RunAssignment:
    """What every rank knows about this run (rank 0 holds the `RecurringJob` itself)."""

    run_id: int
    job_id: str
    batch_size: int
    cost_limit: float | None
    phase: str


@dataclass
class PreparedRun:
    """A run whose batch size was chosen before its engine was built: what `choose_batch_size`
    returns and the adapter hands to the runtime (`PerseusRuntime(prepared_run=...)`)."""

    assignment: RunAssignment
    job: RecurringJob | None  # rank 0 only
    crashed: bool = False  # the script died of an exception: the run was expired
    claimed: bool = False  # a runtime took it over (and reports it at close)


_current: PreparedRun | None = None  # this process's latest run (the exception hook's)
_excepthook_installed = False
_lock = threading.Lock()


def _distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` everywhere, on a gloo group of our own (the job's default group may be
    NCCL, which needs device tensors; this runs before the engine and the runtime exist). The
    group is destroyed once the broadcast is over: one left to interpreter exit can abort the
    process (see `ControlPlane.close`)."""
    dist = _distributed()
    if dist is None:
        return obj
    group = dist.new_group(backend="gloo")
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    return box[0]


def _gpu_max_power_w(config: PerseusConfig, local_rank: int) -> float | None:
    """One GPU's maximum power limit (the cost's MaxPower) when the section does not set it."""
    if config.policy is None or config.policy.max_power_w is not None:
        return None
    from perseus_ext.measurement.gpu import GPUError, open_gpu

    try:
        gpu = open_gpu(config.gpu_spec, local_rank=local_rank, seed=config.seed)
    except GPUError as err:
        raise ConfigError(f"{PREFIX}.policy.max_power_w is needed to price runs: the GPU cannot be "
                          f"opened to read its maximum power limit ({err}); set it in watts") from None
    try:
        return float(gpu.power_limit_range_w()[1])
    finally:
        gpu.close()


def choose_batch_size(config: PerseusConfig, *, num_gpus: int, local_rank: int = 0) -> PreparedRun | None:
    """This run's batch size (`.assignment`), the same on every rank (call on every rank, before
    the engine is built), or None without an enabled batch-size policy. Rank 0 asks the store; a
    failure there fails every rank (no silent default)."""
    global _current
    policy = config.policy
    if not config.enabled or policy is None or policy.batch_size is None:
        return None
    dist = _distributed()
    rank = dist.get_rank() if dist is not None else 0
    answer: tuple[RunAssignment | None, str | None] = (None, None)
    job = None
    if rank == 0:
        try:
            job = start_recurring_job(policy, num_gpus=num_gpus, gpu_max_power_w=_gpu_max_power_w(config, local_rank))
            decision = job.decision
            answer = (RunAssignment(decision.run_id, decision.job_id, decision.batch_size,
                                    decision.cost_limit, decision.phase), None)
        except Exception as err:  # every rank must learn that there is no batch size
            answer = (None, f"{type(err).__name__}: {err}")
    assignment, error = _broadcast_from_rank0(answer)
    if error is not None or assignment is None:
        raise ConfigError(f"{BATCH_SIZE_KEY}: rank 0 could not get this run's batch size from the store "
                          f"({error}); the job does not start with a guessed one")
    prepared = PreparedRun(assignment, job)
    with _lock:
        previous, _current = _current, prepared
    if previous is not None and not previous.claimed and previous.job is not None and previous.job.report is None:
        previous.job.abandon()  # a run prepared but never attached (its engine failed)
        previous.job.close()
    _install_excepthook()
    return prepared


def _install_excepthook() -> None:
    """A run whose script dies of an exception expires at once (not recorded as 'not reached'
    by the exit-time close that follows)."""
    global _excepthook_installed
    if _excepthook_installed:
        return
    _excepthook_installed = True
    previous = sys.excepthook

    def expire_then_report(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        prepared = _current
        if prepared is not None and not isinstance(error, PerseusEarlyStop):
            prepared.crashed = True
            if prepared.job is not None and prepared.job.report is None:
                try:
                    prepared.job.abandon()
                except Exception:  # the store may be what failed; the lease expires the run anyway
                    logger.warning("perseus-ext: could not expire run %d now; its lease will",
                                   prepared.assignment.run_id, exc_info=True)
        previous(kind, error, trace)

    sys.excepthook = expire_then_report


def _claim(prepared: PreparedRun | None) -> PreparedRun:
    if prepared is None:
        raise ConfigError(f"{BATCH_SIZE_KEY} is set but this run got no batch size from the store before its "
                          f"engine was built: build it with deepspeed.initialize (perseus-ext installed) or "
                          f"perseus_ext.megatron.install(args) before computing the number of microbatches")
    prepared.claimed = True
    return prepared


def _shared_signal(policy: Any) -> tuple[Any, str] | None:
    """(the object holding the signal, its attribute) of a policy polling an HTTP endpoint:
    the source worth polling once per job (CSV traces and callbacks are local and keep their
    forecasts on every rank)."""
    holder = None
    if isinstance(policy, PowerBudgetPolicy):
        holder = policy.budget
    elif isinstance(policy, ChasePolicy):
        holder = policy.cost
    if holder is None or not isinstance(getattr(holder, "signal", None), HTTPCarbonSignal):
        return None
    return holder, "signal"


class JobCoordinator:
    """One rank's part of the job-wide exchange at every iteration boundary (see module doc)."""

    def __init__(self, comm: ControlPlane, gpu: Any, *, prepared: PreparedRun | None,
                 target: TargetMetric | None, signal_holder: tuple[Any, str] | None) -> None:
        self.comm = comm
        self.gpu = gpu
        self.assignment = prepared.assignment if prepared is not None else None
        self.job = prepared.job if prepared is not None else None
        self._prepared = prepared
        self.target = target
        self.report: FinishedRun | None = None  # rank 0, once the run is reported
        self.stop_requested = False
        self.reached = False
        self.job_energy_j = 0.0
        self._stop_cost: float | None = None
        self._stop_next = False
        self._reached_local = False
        self._failed = False
        self._last_mj = self._energy_mj()
        self._signal: CarbonSignal | None = None
        if signal_holder is not None:
            holder, attribute = signal_holder
            if comm.rank == 0:
                self._signal = getattr(holder, attribute)
            else:  # one poller per job: this rank's policy reads what rank 0 broadcasts
                own: CarbonSignal = getattr(holder, attribute)
                own.close()
                setattr(holder, attribute, ExternalSignal(own.quantity, own.max_intensity))
                self._signal = getattr(holder, attribute)

    @classmethod
    def create(cls, config: PerseusConfig, comm: ControlPlane, gpu: Any, policy: Any,
               prepared: PreparedRun | None = None) -> "JobCoordinator | None":
        """None unless the job has a batch-size run (`prepared`, from `choose_batch_size`) or a
        signal to share; a power budget's job-wide scope is divided over the job's GPUs here."""
        if isinstance(policy, PowerBudgetPolicy) and policy.budget.scope is BudgetScope.JOB:
            policy.budget.num_gpus = len(comm.members)
        recurring = config.policy is not None and config.policy.batch_size is not None
        holder = _shared_signal(policy) if comm.distributed else None
        if not recurring and holder is None:
            return None
        prepared = _claim(prepared) if recurring else None
        target = target_metric(config.policy) if recurring else None
        return cls(comm, gpu, prepared=prepared, target=target, signal_holder=holder)

    @property
    def batch_size(self) -> int | None:
        return self.assignment.batch_size if self.assignment is not None else None

    def _energy_mj(self) -> float | None:
        if self.gpu is None:
            return None
        try:
            return float(self.gpu.energy_mj())
        except Exception:  # a failing counter costs the run its energy, never the training
            logger.warning("perseus-ext: reading the GPU energy counter failed; this rank's energy "
                           "is left out of the run's cost", exc_info=True)
            self.gpu = None
            return None

    def _energy_since_last_j(self) -> float:
        now = self._energy_mj()
        if now is None or self._last_mj is None:
            return 0.0
        delta, self._last_mj = max(0.0, now - self._last_mj), now
        return delta / 1000.0

    def _signal_reading(self) -> float:
        """Rank 0 reads the real signal at most once per its period; other ranks send nothing."""
        if self.comm.rank != 0 or self._signal is None or isinstance(self._signal, ExternalSignal):
            return 0.0
        value = self._signal.intensity(time.time())  # the poller's last value; never blocks
        return NO_VALUE if value is None else value

    def on_iteration_end(self) -> bool:
        """The boundary's exchange (every rank, every iteration); True: stop the job now."""
        if self._failed:
            return False
        leader = self.comm.rank == 0
        values = [
            self._energy_since_last_j(),
            float(self._stop_next) if leader else 0.0,
            (self._stop_cost or 0.0) if leader else 0.0,
            float(self._reached_local),
            self._signal_reading(),
        ]
        try:
            energy_j, stop, stop_cost, reached, reading = self.comm.all_sum(values)
        except Exception as err:  # a dead or stalled rank: no more job-wide exchanges
            self._failed = True
            logger.error("perseus-ext: the job-wide exchange failed (%r); this rank no longer takes part "
                         "(the run is reported with what was summed so far)", err)
            return False
        self.job_energy_j += energy_j
        if isinstance(self._signal, ExternalSignal) and reading >= 0:
            self._signal.feed(reading)
        if reached > 0 and not self.reached:
            self._reach()  # reported on another rank since the last boundary
        if self.reached:
            return False  # a run that reached its target is never stopped
        if stop > 0:
            self.stop_requested = True
            self._stop_cost = stop_cost
            return True
        if leader and self.job is not None and self.job.report is None and self.job.record_iteration(energy_j):
            self._stop_next = True
            self._stop_cost = self.job.cost
        return False

    def _reach(self) -> None:
        """The target is reached: recorded as reached (rank 0) even if rank 0 decided to stop
        at the last boundary, since that stop has not happened yet; no stop follows."""
        self.reached = True
        self._stop_next = False
        if self.job is not None and self.job.report is None:
            self.job.finish(RunOutcome.REACHED)

    def report_metric(self, value: float) -> bool:
        """One evaluation result (call it on any rank; on rank 0 it is recorded at once, on
        another at the next iteration boundary). True once the target is reached."""
        if self.target is None:
            raise ConfigError(f"report_metric needs {BATCH_SIZE_KEY}.target_metric "
                              f"(name, value, higher_is_better) in the config")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"report_metric: {self.target.name} must be a finite number, got {value!r}")
        # The same answer on every rank for the same value: ranks stop training on it together.
        reached = self.reached or (not self.stop_requested and self.target.is_reached(float(value)))
        if reached and not self.reached:
            self._reach()
        self._reached_local = self._reached_local or reached
        return reached

    def early_stop(self) -> PerseusEarlyStop:
        """The exception every rank raises at the agreed boundary (rank 0's figures)."""
        assert self.assignment is not None
        limit = self.assignment.cost_limit
        return PerseusEarlyStop(self.assignment.run_id, self.assignment.batch_size,
                                self._stop_cost or 0.0, limit if limit is not None else math.inf)

    def close(self) -> None:
        """Report the run (rank 0): stopped, reached, or ended without reaching its target; a
        run whose script died of an exception was expired instead."""
        job = self.job
        if job is None:
            return
        self.job = None
        try:
            if self._prepared is not None and self._prepared.crashed:
                job.abandon()
            else:
                self.report = job.finish()
        except Exception:
            logger.exception("perseus-ext: reporting run %d to the batch-size store failed; it expires "
                             "after its lease", job.decision.run_id)
        finally:
            job.close()
