"""Zeus' batch-size optimizer for recurring jobs, with its state in a SQL store (bso_store.py).

Each run of a recurring job asks `suggest()` for a batch size and reports the run's time and
energy at the end. The cost of a run is Zeus' ``eta * Energy + (1 - eta) * n_gpus * MaxPower * Time``
(time and energy to reach the job's target). Two phases:

1. Pruning (`pruning_rounds` rounds, default 2): try the default batch size, then smaller ones
   in decreasing order, then larger ones in increasing order; a batch size that fails to reach
   the target (stopped early, or ended without reaching it) ends exploration in its direction
   and everything beyond it is pruned. Running runs count as tries, so concurrent runs of the
   job explore different sizes.
2. Gaussian Thompson sampling over the surviving batch sizes: sample each one's mean cost from
   its posterior N(mean, variance / n) and run the cheapest sample.

Early stopping: every suggestion carries ``cost_limit = beta x best cost so far``; a run whose
cost passes it stops and is reported as stopped (`recurring_job.RecurringJob` does this).

Crashed runs: a run holds a lease of `lease_s` seconds that its heartbeats renew; a run whose
lease ran out is marked expired by the next write. Expired runs count neither as tries nor as
observations. A late report of an expired run is still accepted (it was alive after all).
"""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from sqlalchemy import Connection, or_, select

from perseus_ext.config.policy import DEFAULT_LEASE_S
from perseus_ext.errors import ConfigError
from perseus_ext.policies.bso_store import (
    DEFAULT_NETWORK_TIMEOUT_S,
    TIMEOUT_KEY,
    Store,
    StoreError,
    jobs_table,
    runs_table,
)
from perseus_ext.policies.cost import ZeusCost, check_positive

#: Relative cost noise assumed while no batch size has two observations to estimate it from.
DEFAULT_RELATIVE_STD = 0.1

BATCH_SIZE_KEY = "perseus.policy.batch_size"
RUNNING, EXPIRED = "running", "expired"


class RunOutcome(str, enum.Enum):
    """How a run ended. Only REACHED counts as a success; the other two prune their size."""

    REACHED = "reached"  # reached the job's target
    STOPPED = "stopped"  # early-stopped: its cost passed the cost limit
    NOT_REACHED = "not_reached"  # ended normally without reaching the target


FAILED = (RunOutcome.STOPPED.value, RunOutcome.NOT_REACHED.value)


@dataclass(frozen=True)
class Suggestion:
    """What the next run of the job should use. Report it back with its `run_id`."""

    run_id: int
    job_id: str
    batch_size: int
    phase: str  # "prune" or "thompson"
    cost_limit: float | None  # stop the run once its cost exceeds this; None = no limit yet
    lease_s: float  # send a heartbeat well within this, or the run is taken for crashed


@dataclass
class ArmState:
    """Everything known about one candidate batch size."""

    batch_size: int
    costs: list[float] = field(default_factory=list)  # finished runs: reached or failed
    reached: int = 0
    stopped: int = 0
    not_reached: int = 0
    running: int = 0
    expired: int = 0
    pruned: bool = False

    @property
    def failed(self) -> int:
        return self.stopped + self.not_reached

    @property
    def mean_cost(self) -> float | None:
        return float(np.mean(self.costs)) if self.costs else None


@dataclass
class JobState:
    """A job's settings and per-batch-size statistics, as derived from its runs."""

    job_id: str
    batch_sizes: list[int]
    default_batch_size: int
    eta: float
    max_power_w: float
    beta: float
    arms: dict[int, ArmState]
    num_runs: int

    @property
    def best_cost(self) -> float | None:
        """Cheapest run that reached the target (the early-stopping reference)."""
        costs = [c for arm in self.arms.values() if arm.reached for c in arm.costs]
        return min(costs) if costs else None

    @property
    def cost_limit(self) -> float | None:
        best = self.best_cost
        return None if best is None else self.beta * best

    @property
    def best_batch_size(self) -> int | None:
        """Surviving batch size with the lowest mean cost (the current exploitation choice)."""
        scored = [
            (a.mean_cost, a.batch_size) for a in self.arms.values() if a.reached and not a.pruned
        ]
        return min(scored)[1] if scored else None

    def exploration_order(self) -> list[list[int]]:
        """Pruning walks after the default: smaller sizes descending, larger ascending."""
        below = sorted((b for b in self.batch_sizes if b < self.default_batch_size), reverse=True)
        above = sorted(b for b in self.batch_sizes if b > self.default_batch_size)
        return [[self.default_batch_size], below, above]

    def mark_pruned(self) -> None:
        """A batch size whose runs never reached the target is pruned, and so is everything
        beyond it in its walk (a smaller/larger size is assumed no better)."""
        for walk in self.exploration_order():
            failed = False
            for batch_size in walk:
                arm = self.arms[batch_size]
                arm.pruned = failed or (arm.failed > 0 and arm.reached == 0)
                failed = arm.pruned

    def next_to_explore(self, rounds: int) -> int | None:
        """In round r, the first unpruned batch size with fewer than r runs: the default, then
        along each walk (running runs count, so concurrent jobs explore different sizes);
        None once every round is done. Two rounds give each survivor two observations before
        sampling, so one unlucky first run cannot bury the best batch size."""
        for round_number in range(1, rounds + 1):
            for walk in self.exploration_order():
                for batch_size in walk:
                    arm = self.arms[batch_size]
                    if arm.pruned:
                        break
                    if len(arm.costs) + arm.running < round_number:
                        return batch_size
        return None


def check_batch_sizes(batch_sizes: Sequence[int], default_batch_size: int) -> list[int]:
    sizes = list(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ConfigError(
            f"{BATCH_SIZE_KEY}.batch_sizes must be a non-empty list of positive integers, "
            f"got {sizes!r}"
        )
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"{BATCH_SIZE_KEY}.batch_sizes has duplicates: {sizes!r}")
    if default_batch_size not in sizes:
        raise ConfigError(
            f"{BATCH_SIZE_KEY}.default_batch_size {default_batch_size!r} must be one of "
            f"batch_sizes {sorted(sizes)}"
        )
    return sorted(sizes)


def _check_number(value: object, key: str, low: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < math.inf:
        raise ConfigError(f"{BATCH_SIZE_KEY}.{key} must be a number > {low:g} ({what}), got {value!r}")
    return float(value)


class BatchSizeOptimizer:
    """Suggests batch sizes for one recurring job (`job_id`) kept in the store at `store`
    (a path, ``sqlite:///path`` or ``postgresql://...``; see bso_store.py)."""

    def __init__(
        self,
        store: str | Path | Store,
        job_id: str,
        batch_sizes: Sequence[int],
        default_batch_size: int,
        *,
        eta: float = 0.5,
        max_power_w: float,
        beta: float = 2.0,
        pruning_rounds: int = 2,
        seed: int | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        busy_timeout_s: float = 60.0,
        network_timeout_s: float = DEFAULT_NETWORK_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ):
        if not job_id or not isinstance(job_id, str):
            raise ConfigError(f"{BATCH_SIZE_KEY}.job_id must be a non-empty string, got {job_id!r}")
        self.job_id = job_id
        self.batch_sizes = check_batch_sizes(batch_sizes, default_batch_size)
        self.default_batch_size = default_batch_size
        self.cost = ZeusCost(eta, max_power_w)
        self.beta = _check_number(beta, "beta", 1.0, "stop runs costing beta x the best")
        if (
            isinstance(pruning_rounds, bool)
            or not isinstance(pruning_rounds, int)
            or pruning_rounds < 1
        ):
            raise ConfigError(
                f"{BATCH_SIZE_KEY}.pruning_rounds must be an integer >= 1, got {pruning_rounds!r}"
            )
        self.pruning_rounds = pruning_rounds
        self.seed = seed
        self.lease_s = _check_number(lease_s, "lease_s", 0.0, "seconds without a heartbeat")
        self.clock = clock
        self.store = (
            store if isinstance(store, Store)
            else Store(store, busy_timeout_s=busy_timeout_s, network_timeout_s=network_timeout_s)
        )
        self._register()

    @property
    def location(self) -> str:
        return self.store.name

    def close(self) -> None:
        """Close this process's connections (they reopen on the next call)."""
        self.store.close()

    def __enter__(self) -> "BatchSizeOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settings(self) -> tuple:
        return (self.batch_sizes, self.default_batch_size, self.cost.eta, self.cost.max_power_w, self.beta)

    def _register(self) -> None:
        """Insert the job, or check that its stored settings are ours (else costs would not be
        comparable). Insert-if-absent is atomic on both backends, so racing first runs agree."""
        with self.store.transaction() as db:
            jobs = jobs_table.c
            found = db.execute(select(jobs.job_id).where(jobs.job_id == self.job_id)).first()
            if found is None:
                insert = self.store.insert(jobs_table).values(
                    job_id=self.job_id,
                    batch_sizes=json.dumps(self.batch_sizes),
                    default_batch_size=self.default_batch_size,
                    eta=self.cost.eta,
                    max_power_w=self.cost.max_power_w,
                    beta=self.beta,
                    created=self.clock(),
                )
                db.execute(insert.on_conflict_do_nothing(index_elements=["job_id"]))
            row = db.execute(
                select(jobs.batch_sizes, jobs.default_batch_size, jobs.eta, jobs.max_power_w, jobs.beta)
                .where(jobs.job_id == self.job_id)
            ).one()
        stored = (json.loads(row[0]), *row[1:])
        if stored != self._settings():
            raise ConfigError(
                f"job {self.job_id!r} in {self.location} was registered with batch_sizes, default, "
                f"eta, max_power_w, beta = {stored}, not {self._settings()}; costs would not be "
                f"comparable, so use a new {BATCH_SIZE_KEY}.job_id or the original settings"
            )

    def _expire(self, db: Connection, now: float) -> None:
        """Mark this job's runs whose lease ran out as expired (their process is gone)."""
        runs = runs_table.c
        db.execute(
            runs_table.update()
            .where(
                runs.job_id == self.job_id,
                runs.status == RUNNING,
                runs.heartbeat + runs.lease_s < now,
            )
            .values(status=EXPIRED, finished=now)
        )

    def suggest(self) -> Suggestion:
        """Pick the next run's batch size and record the run as started (lease from now)."""
        now = self.clock()
        with self.store.transaction(self.job_id) as db:
            self._expire(db, now)
            state = load_job(db, self.job_id)
            batch_size = state.next_to_explore(self.pruning_rounds)
            phase = "prune"
            if batch_size is None:
                phase = "thompson"
                batch_size = self._thompson(state)
            run_id = db.execute(
                runs_table.insert()
                .values(
                    job_id=self.job_id,
                    batch_size=batch_size,
                    phase=phase,
                    status=RUNNING,
                    started=now,
                    heartbeat=now,
                    lease_s=self.lease_s,
                )
                .returning(runs_table.c.run_id)
            ).scalar_one()
        return Suggestion(int(run_id), self.job_id, batch_size, phase, state.cost_limit, self.lease_s)

    def _thompson(self, state: JobState) -> int:
        arms = [a for a in state.arms.values() if a.costs and not a.pruned]
        if not arms:  # everything pruned or still running: fall back to the user's default
            return state.default_batch_size
        variance = _pooled_variance(arms)
        rng = np.random.default_rng(None if self.seed is None else [self.seed, state.num_runs])
        samples = [rng.normal(a.mean_cost, math.sqrt(variance / len(a.costs))) for a in arms]
        return arms[int(np.argmin(samples))].batch_size

    def _status(self, db: Connection, run_id: int) -> str:
        row = db.execute(
            select(runs_table.c.job_id, runs_table.c.status).where(runs_table.c.run_id == run_id)
        ).first()
        if row is None or row[0] != self.job_id:
            raise ConfigError(f"run {run_id} is not a run of job {self.job_id!r} in {self.location}")
        return str(row[1])

    def heartbeat(self, run_id: int) -> None:
        """Renew a run's lease. A run already expired comes back to running (it was slow, not
        dead); a finished run is an error."""
        now = self.clock()
        runs = runs_table.c
        with self.store.transaction(self.job_id) as db:
            updated = db.execute(
                runs_table.update()
                .where(runs.run_id == run_id, runs.job_id == self.job_id, runs.status.in_((RUNNING, EXPIRED)))
                .values(status=RUNNING, heartbeat=now, finished=None)
            ).rowcount
            if updated != 1:
                raise ConfigError(
                    f"run {run_id} of job {self.job_id!r} was already reported "
                    f"({self._status(db, run_id)}); it needs no heartbeat"
                )

    def abandon(self, run_id: int) -> None:
        """Expire a running run at once (its process is failing); it counts for nothing."""
        now = self.clock()
        runs = runs_table.c
        with self.store.transaction(self.job_id) as db:
            db.execute(
                runs_table.update()
                .where(runs.run_id == run_id, runs.job_id == self.job_id, runs.status == RUNNING)
                .values(status=EXPIRED, finished=now)
            )

    def report(
        self,
        run_id: int,
        time_s: float,
        energy_j: float,
        *,
        num_gpus: int = 1,
        outcome: RunOutcome = RunOutcome.REACHED,
    ) -> float:
        """Finish a run: its time and total energy (all GPUs) up to the target, the early stop
        or the end. Exactly one report per run is accepted. Returns the run's cost."""
        check_positive(time_s, "time_s", "seconds")
        if isinstance(energy_j, bool) or not isinstance(energy_j, (int, float)) or not (
            0 <= energy_j < math.inf
        ):
            raise ConfigError(f"energy_j must be a finite number of joules >= 0, got {energy_j!r}")
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise ConfigError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        outcome = RunOutcome(outcome)
        cost = self.cost.weights().cost(time_s, energy_j, num_gpus)
        runs = runs_table.c
        with self.store.transaction(self.job_id) as db:
            updated = db.execute(
                runs_table.update()
                .where(
                    runs.run_id == run_id,
                    runs.job_id == self.job_id,
                    or_(runs.status == RUNNING, runs.status == EXPIRED),
                )
                .values(
                    status=outcome.value,
                    finished=self.clock(),
                    time_s=float(time_s),
                    energy_j=float(energy_j),
                    num_gpus=num_gpus,
                    cost=cost,
                )
            ).rowcount
            if updated != 1:
                raise ConfigError(
                    f"run {run_id} of job {self.job_id!r} was already reported "
                    f"({self._status(db, run_id)})"
                )
        return cost

    def state(self) -> JobState:
        with self.store.transaction(self.job_id) as db:
            self._expire(db, self.clock())
            return load_job(db, self.job_id)


def _pooled_variance(arms: Sequence[ArmState]) -> float:
    """Within-arm variance pooled over arms (costs of one batch size differ only by noise);
    a relative default while fewer than two observations share an arm."""
    squares = sum(float(np.sum((np.array(a.costs) - a.mean_cost) ** 2)) for a in arms)
    dof = sum(len(a.costs) - 1 for a in arms)
    if dof > 0 and squares > 0:
        return squares / dof
    scale = float(np.mean([a.mean_cost for a in arms]))
    return (DEFAULT_RELATIVE_STD * scale) ** 2 or 1.0


def load_job(db: Connection, job_id: str, now: float | None = None) -> JobState:
    """A job's state from its runs. With `now`, a running run whose lease ran out is counted as
    expired without writing (read-only inspection)."""
    jobs, runs = jobs_table.c, runs_table.c
    row = db.execute(
        select(jobs.batch_sizes, jobs.default_batch_size, jobs.eta, jobs.max_power_w, jobs.beta)
        .where(jobs.job_id == job_id)
    ).first()
    if row is None:
        raise ConfigError(f"no batch-size job {job_id!r} in this store")
    sizes = json.loads(row[0])
    arms = {b: ArmState(b) for b in sizes}
    num_runs = 0
    query = (
        select(runs.batch_size, runs.status, runs.cost, runs.heartbeat, runs.lease_s)
        .where(runs.job_id == job_id)
        .order_by(runs.run_id)
    )
    for batch_size, status, cost, heartbeat, lease_s in db.execute(query):
        num_runs += 1
        arm = arms.get(batch_size)
        if arm is None:
            continue
        if status == RUNNING and now is not None and heartbeat + lease_s < now:
            status = EXPIRED
        if status == RUNNING:
            arm.running += 1
        elif status == EXPIRED:
            arm.expired += 1
        else:
            arm.costs.append(float(cost))
            if status == RunOutcome.REACHED.value:
                arm.reached += 1
            elif status == RunOutcome.STOPPED.value:
                arm.stopped += 1
            else:
                arm.not_reached += 1
    state = JobState(
        job_id, sizes, int(row[1]), float(row[2]), float(row[3]), float(row[4]), arms, num_runs
    )
    state.mark_pruned()
    return state


def read_states(
    location: str | Path, job_id: str | None = None, *, migrate: bool = False,
    network_timeout_s: float = DEFAULT_NETWORK_TIMEOUT_S, timeout_key: str = TIMEOUT_KEY,
) -> list[JobState]:
    """Every job's state in a store (or one job's). Read-only unless `migrate` (which first
    upgrades an older store's schema); safe while runs are writing."""
    store = Store(location, read_only=not migrate, network_timeout_s=network_timeout_s, timeout_key=timeout_key)
    try:
        with store.transaction() as db:
            ids = list(db.execute(select(jobs_table.c.job_id).order_by(jobs_table.c.job_id)).scalars())
            if job_id is not None:
                if job_id not in ids:
                    raise StoreError(f"{store.name} has no job {job_id!r}; jobs: {ids}")
                ids = [job_id]
            now = time.time()
            return [load_job(db, j, now) for j in ids]
    finally:
        store.close()
