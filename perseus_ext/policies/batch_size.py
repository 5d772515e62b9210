"""Zeus' batch-size optimizer for recurring jobs, with its state in a local SQLite file.

Each run of a recurring job asks `suggest()` for a batch size and reports the run's time and
energy at the end. The cost of a run is Zeus' ``eta * Energy + (1 - eta) * n_gpus * MaxPower * Time``
(time and energy to reach the job's target). Two phases:

1. Pruning (`pruning_rounds` rounds, default 2): try the default batch size, then smaller ones
   in decreasing order, then larger ones in increasing order; a batch size that fails to reach
   the target (or is stopped early) ends exploration in its direction and everything beyond
   it is pruned.
2. Gaussian Thompson sampling over the surviving batch sizes: sample each one's mean cost from
   its posterior N(mean, variance / n) and run the cheapest sample.

Early stopping: every suggestion carries ``cost_limit = beta x best cost so far``; the runtime
stops a run whose cost passes it and reports it with ``reached_target=False``.

Several jobs may share one file: every read-modify-write is one ``BEGIN IMMEDIATE`` transaction
in WAL mode, with a busy timeout, so concurrent processes serialise instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from perseus_ext.errors import ConfigError
from perseus_ext.policies.cost import ZeusCost, check_positive

#: Relative cost noise assumed while no batch size has two observations to estimate it from.
DEFAULT_RELATIVE_STD = 0.1

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    batch_sizes TEXT NOT NULL,
    default_batch_size INTEGER NOT NULL,
    eta REAL NOT NULL,
    max_power_w REAL NOT NULL,
    beta REAL NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    batch_size INTEGER NOT NULL,
    phase TEXT NOT NULL,
    status TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    time_s REAL,
    energy_j REAL,
    num_gpus INTEGER,
    cost REAL
);
CREATE INDEX IF NOT EXISTS runs_by_job ON runs(job_id, batch_size);
"""

RUNNING, REACHED, STOPPED = "running", "reached", "stopped"
BATCH_SIZE_KEY = "perseus.policy.batch_size"


@dataclass(frozen=True)
class Suggestion:
    """What the next run of the job should use. Report it back with its `run_id`."""

    run_id: int
    job_id: str
    batch_size: int
    phase: str  # "prune" or "thompson"
    cost_limit: float | None  # stop the run once its cost exceeds this; None = no limit yet


@dataclass
class ArmState:
    """Everything known about one candidate batch size."""

    batch_size: int
    costs: list[float] = field(default_factory=list)  # finished runs, reached or stopped
    reached: int = 0
    stopped: int = 0
    running: int = 0
    pruned: bool = False

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
                arm.pruned = failed or (arm.stopped > 0 and arm.reached == 0)
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
        raise ConfigError(f"perseus.policy.batch_size.batch_sizes has duplicates: {sizes!r}")
    if default_batch_size not in sizes:
        raise ConfigError(
            f"{BATCH_SIZE_KEY}.default_batch_size {default_batch_size!r} must be one of "
            f"batch_sizes {sorted(sizes)}"
        )
    return sorted(sizes)


class BatchSizeOptimizer:
    """Suggests batch sizes for one recurring job (`job_id`) stored in `path`."""

    def __init__(
        self,
        path: str | Path,
        job_id: str,
        batch_sizes: Sequence[int],
        default_batch_size: int,
        *,
        eta: float = 0.5,
        max_power_w: float,
        beta: float = 2.0,
        pruning_rounds: int = 2,
        seed: int | None = None,
        busy_timeout_s: float = 60.0,
    ):
        if not job_id or not isinstance(job_id, str):
            raise ConfigError(
                f"perseus.policy.batch_size.job_id must be a non-empty string, got {job_id!r}"
            )
        self.path = Path(path)
        self.job_id = job_id
        self.batch_sizes = check_batch_sizes(batch_sizes, default_batch_size)
        self.default_batch_size = default_batch_size
        self.cost = ZeusCost(eta, max_power_w)
        if (
            isinstance(beta, bool)
            or not isinstance(beta, (int, float))
            or not 1.0 < beta < math.inf
        ):
            raise ConfigError(
                f"{BATCH_SIZE_KEY}.beta must be a number > 1 (stop runs costing beta x the "
                f"best), got {beta!r}"
            )
        self.beta = float(beta)
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
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._db_pid = 0
        with self._transaction() as db:
            self._register(db)

    def _connection(self) -> sqlite3.Connection:
        """This process's connection, opened on first use (and again after a fork). Keeping it
        open avoids a WAL checkpoint per call when the last connection closes."""
        if self._db is None or self._db_pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
            self._enable_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")  # WAL stays consistent; only skips fsyncs
            self._db, self._db_pid = db, os.getpid()
        return self._db

    def _enable_wal(self, db: sqlite3.Connection) -> None:
        """Switch the file to WAL mode. SQLite answers "database is locked" at once, without
        calling the busy handler, when another process is creating the file or switching it
        at the same moment, so retry until the busy timeout."""
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE takes the write lock up front, so two
        processes never both read stale state and then write; others wait up to the busy timeout."""
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def close(self) -> None:
        """Close this process's connection (it reopens on the next call)."""
        if self._db is not None and self._db_pid == os.getpid():
            self._db.close()
        self._db = None

    def __enter__(self) -> "BatchSizeOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self, db: sqlite3.Connection) -> None:
        row = db.execute(
            "SELECT batch_sizes, default_batch_size, eta, max_power_w, beta FROM jobs WHERE job_id = ?",
            (self.job_id,),
        ).fetchone()
        mine = (
            self.batch_sizes,
            self.default_batch_size,
            self.cost.eta,
            self.cost.max_power_w,
            self.beta,
        )
        if row is None:
            db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?)",
                (self.job_id, json.dumps(self.batch_sizes), *mine[1:], time.time()),
            )
            return
        stored = (json.loads(row[0]), *row[1:])
        if stored != mine:
            raise ConfigError(
                f"job {self.job_id!r} in {self.path} was registered with batch_sizes, default, eta, "
                f"max_power_w, beta = {stored}, not {mine}; costs would not be comparable, so use "
                f"a new perseus.policy.batch_size.job_id or the original settings"
            )

    def suggest(self) -> Suggestion:
        """Pick the next run's batch size and record the run as started."""
        with self._transaction() as db:
            state = load_job(db, self.job_id)
            batch_size = state.next_to_explore(self.pruning_rounds)
            phase = "prune"
            if batch_size is None:
                phase = "thompson"
                batch_size = self._thompson(state)
            cursor = db.execute(
                "INSERT INTO runs (job_id, batch_size, phase, status, started) VALUES (?, ?, ?, ?, ?)",
                (self.job_id, batch_size, phase, RUNNING, time.time()),
            )
            return Suggestion(
                int(cursor.lastrowid), self.job_id, batch_size, phase, state.cost_limit
            )

    def _thompson(self, state: JobState) -> int:
        arms = [a for a in state.arms.values() if a.costs and not a.pruned]
        if not arms:  # everything pruned or still running: fall back to the user's default
            return state.default_batch_size
        variance = _pooled_variance(arms)
        rng = np.random.default_rng(None if self.seed is None else [self.seed, state.num_runs])
        samples = [rng.normal(a.mean_cost, math.sqrt(variance / len(a.costs))) for a in arms]
        return arms[int(np.argmin(samples))].batch_size

    def report(
        self,
        run_id: int,
        time_s: float,
        energy_j: float,
        *,
        num_gpus: int = 1,
        reached_target: bool = True,
    ) -> float:
        """Finish a run: its time and total energy (all GPUs) up to the target or to the early
        stop. Returns the run's cost."""
        check_positive(time_s, "time_s", "seconds")
        if energy_j < 0 or not math.isfinite(energy_j):
            raise ConfigError(f"energy_j must be a finite number of joules >= 0, got {energy_j!r}")
        cost = self.cost.weights().cost(time_s, energy_j, num_gpus)
        with self._transaction() as db:
            row = db.execute(
                "SELECT job_id, status FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if row is None or row[0] != self.job_id:
                raise ConfigError(
                    f"run {run_id} is not a run of job {self.job_id!r} in {self.path}"
                )
            if row[1] != RUNNING:
                raise ConfigError(
                    f"run {run_id} of job {self.job_id!r} was already reported ({row[1]})"
                )
            db.execute(
                "UPDATE runs SET status = ?, finished = ?, time_s = ?, energy_j = ?, num_gpus = ?, "
                "cost = ? WHERE run_id = ?",
                (
                    REACHED if reached_target else STOPPED,
                    time.time(),
                    time_s,
                    energy_j,
                    num_gpus,
                    cost,
                    run_id,
                ),
            )
        return cost

    def state(self) -> JobState:
        with self._transaction() as db:
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


def load_job(db: sqlite3.Connection, job_id: str) -> JobState:
    row = db.execute(
        "SELECT batch_sizes, default_batch_size, eta, max_power_w, beta FROM jobs WHERE job_id = ?",
        (job_id,),
    ).fetchone()
    if row is None:
        raise ConfigError(f"no batch-size job {job_id!r} in this database")
    sizes = json.loads(row[0])
    arms = {b: ArmState(b) for b in sizes}
    num_runs = 0
    for batch_size, status, cost in db.execute(
        "SELECT batch_size, status, cost FROM runs WHERE job_id = ? ORDER BY run_id", (job_id,)
    ):
        num_runs += 1
        arm = arms.get(batch_size)
        if arm is None:
            continue
        if status == RUNNING:
            arm.running += 1
            continue
        arm.costs.append(float(cost))
        if status == REACHED:
            arm.reached += 1
        else:
            arm.stopped += 1
    state = JobState(
        job_id, sizes, int(row[1]), float(row[2]), float(row[3]), float(row[4]), arms, num_runs
    )
    state.mark_pruned()
    return state


def read_states(path: str | Path, job_id: str | None = None) -> list[JobState]:
    """Every job's state in `path` (or one job's), opened read-only for inspection."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"batch-size database {path} does not exist; check perseus.policy.batch_size.db"
        )
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    try:
        try:
            ids = [r[0] for r in db.execute("SELECT job_id FROM jobs ORDER BY job_id")]
        except sqlite3.DatabaseError as err:
            raise ConfigError(f"{path} is not a perseus-ext batch-size database ({err})") from None
        if job_id is not None:
            if job_id not in ids:
                raise ConfigError(f"{path} has no job {job_id!r}; jobs: {ids}")
            ids = [job_id]
        return [load_job(db, j) for j in ids]
    finally:
        db.close()
