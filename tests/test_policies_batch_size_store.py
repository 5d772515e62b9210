"""The batch-size store's guarantees, tested the same way on both backends: an SQLite file and a
real PostgreSQL server that the `postgres` fixture starts on a loopback port (those cases skip,
with the reason, where the server cannot start).

* 8 concurrent writers, some SIGKILLed mid-transaction: no report is lost or doubled, and the
  killed runs expire;
* concurrent runs spread over the batch sizes while pruning;
* leases: a crashed run expires, a late report is still taken, a heartbeat keeps a run alive;
* schema versions: an older store is migrated, a newer or foreign one is refused clearly;
* `perseus-ext batch-size URL`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
from sqlalchemy import create_engine, event, text

from perseus_ext.commands import batch_size as batch_size_command
from perseus_ext.errors import ConfigError
from perseus_ext.policies.batch_size import BatchSizeOptimizer, RunOutcome, read_states
from perseus_ext.policies.bso_store import SCHEMA_VERSION, Store, StoreError, store_url
from postgres_server import PostgresServer

JOB = "nightly-gpt"
SIZES = [8, 16, 32, 64, 128, 256, 512]
MEANS = {8: 3.0, 16: 2.0, 32: 1.3, 64: 1.0, 128: 1.15, 256: 1.6, 512: None}
MAX_POWER_W = 300.0
WRITERS = 8
KILLS = 8
STATEMENT_DELAY_S = 0.002  # widens every transaction so that kills land inside one


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'bso.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_database(f"bso_{uuid.uuid4().hex[:12]}")


def optimizer(url: str, clock: Callable[[], float] = time.time, **kwargs) -> BatchSizeOptimizer:
    return BatchSizeOptimizer(
        url, JOB, SIZES, 128, eta=0.5, max_power_w=MAX_POWER_W, clock=clock, **kwargs
    )


def finish(bso: BatchSizeOptimizer, run_id: int, batch_size: int, rng: random.Random) -> float:
    """Report one run of the synthetic job (cost = mean x noise; 512 never converges)."""
    mean = MEANS[batch_size]
    cost = 2.0e6 if mean is None else mean * 1e6 * (1 + 0.05 * rng.gauss(0.0, 1.0))
    outcome = RunOutcome.NOT_REACHED if mean is None else RunOutcome.REACHED
    return bso.report(run_id, time_s=cost / MAX_POWER_W, energy_j=cost, outcome=outcome)


def _writer(url: str, log_path: str, stop_path: str, seed: int) -> None:
    """Suggest and report in a loop, logging each committed step (os.write survives SIGKILL)."""
    bso = optimizer(url, lease_s=30.0)
    event.listen(
        bso.store.engine(), "after_cursor_execute", lambda *_: time.sleep(STATEMENT_DELAY_S)
    )
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while not os.path.exists(stop_path):
        suggestion = bso.suggest()
        os.write(log, f"S {suggestion.run_id}\n".encode())
        cost = finish(bso, suggestion.run_id, suggestion.batch_size, rng)
        os.write(log, f"R {suggestion.run_id} {cost!r}\n".encode())
    os.close(log)


@pytest.mark.distributed
def test_eight_writers_with_sigkills_lose_and_double_nothing(url: str, tmp_path: Path) -> None:
    optimizer(url).close()  # the job exists; writers race on runs only
    context = multiprocessing.get_context("fork")  # the store reopens its connections after fork
    stop = tmp_path / "stop"
    rng = random.Random(0)
    procs: dict[int, multiprocessing.Process] = {}

    def start(seed: int) -> None:
        proc = context.Process(
            target=_writer, args=(url, str(tmp_path / f"w{seed}.log"), str(stop), seed)
        )
        proc.start()
        procs[seed] = proc

    for seed in range(WRITERS):
        start(seed)
    time.sleep(1.0)
    for kill in range(KILLS):
        time.sleep(rng.uniform(0.05, 0.25))
        victim = rng.choice(sorted(s for s, p in procs.items() if p.is_alive()))
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(10)
        start(WRITERS + kill)  # keep 8 writers going
    time.sleep(0.5)
    stop.touch()
    for proc in procs.values():
        proc.join(60)
    killed = {s for s, p in procs.items() if p.exitcode == -signal.SIGKILL}
    assert len(killed) == KILLS
    assert all(p.exitcode == 0 for s, p in procs.items() if s not in killed)

    suggested: set[int] = set()
    reported: dict[int, float] = {}
    for log in tmp_path.glob("w*.log"):
        for line in log.read_text().splitlines():
            kind, run_id, *cost = line.split()
            if kind == "S":
                suggested.add(int(run_id))
            else:
                assert int(run_id) not in reported  # one report per run
                reported[int(run_id)] = float(cost[0])
    store = Store(url)
    with store.transaction() as db:
        rows = {r[0]: (r[1], r[2]) for r in db.execute(text("SELECT run_id, status, cost FROM runs"))}
    store.close()
    assert len(reported) > 50  # the writers did make progress
    # Nothing lost: every committed suggestion and report is there, with its cost.
    assert suggested <= set(rows)
    for run_id, cost in reported.items():
        assert rows[run_id][0] in ("reached", "not_reached") and rows[run_id][1] == cost
    # Nothing extra: at most one step per killed writer committed without being logged.
    assert len(set(rows) - suggested) <= KILLS
    finished = {r for r, (status, _) in rows.items() if status != "running"}
    assert len(finished - set(reported)) <= KILLS
    running = {r for r, (status, _) in rows.items() if status == "running"}
    assert len(running) <= KILLS
    # The killed writers' runs expire once their lease runs out; every report counts once.
    state = optimizer(url, clock=lambda: time.time() + 60.0).state()
    assert sum(a.running for a in state.arms.values()) == 0
    assert sum(a.expired for a in state.arms.values()) == len(running)
    assert sum(len(a.costs) for a in state.arms.values()) == len(finished)


def _suggest_once(url: str, start, results) -> None:  # noqa: ANN001 (multiprocessing objects)
    bso = optimizer(url)
    start.wait(30)
    results.put(bso.suggest().batch_size)


@pytest.mark.distributed
def test_concurrent_runs_spread_across_sizes(url: str) -> None:
    optimizer(url).close()
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(WRITERS), context.Queue()
    procs = [context.Process(target=_suggest_once, args=(url, start, results)) for _ in range(WRITERS)]
    for proc in procs:
        proc.start()
    sizes = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    # Round 1 of pruning gives each of the 7 sizes to one run; the 8th starts round 2 (default).
    assert sizes == sorted(SIZES + [128])


def test_crashed_run_expires_and_late_reports_count(url: str) -> None:
    now = [1000.0]
    bso = optimizer(url, clock=lambda: now[0], lease_s=60.0, pruning_rounds=1)
    crashed = bso.suggest()
    assert crashed.batch_size == 128 and crashed.lease_s == 60.0
    assert bso.suggest().batch_size == 64  # 128 is taken by a running run
    now[0] += 30.0
    bso.heartbeat(crashed.run_id)
    now[0] += 45.0  # 75 s after the start, 45 s after the heartbeat: alive
    assert bso.state().arms[128].running == 1
    now[0] += 16.0  # 61 s without a heartbeat: taken for crashed
    state = bso.state()
    assert state.arms[128].running == 0 and state.arms[128].expired == 1
    assert state.arms[64].expired == 1  # never sent a heartbeat at all
    assert bso.suggest().batch_size == 128  # explored again
    # The "crashed" run reports after all: accepted once, never twice.
    bso.report(crashed.run_id, 100.0, 2.0e4)
    with pytest.raises(ConfigError, match="already reported"):
        bso.report(crashed.run_id, 100.0, 2.0e4)
    with pytest.raises(ConfigError, match="already reported"):
        bso.heartbeat(crashed.run_id)
    abandoned = bso.suggest()
    bso.abandon(abandoned.run_id)
    assert bso.state().arms[abandoned.batch_size].expired >= 1
    assert read_states(url)[0].arms[128].reached == 1


V1_TABLES = {
    "sqlite": "run_id INTEGER PRIMARY KEY AUTOINCREMENT",
    "postgresql": "run_id SERIAL PRIMARY KEY",
}


def make_v1_store(url: str) -> None:
    """The tables perseus-ext 0.1 wrote, with one finished and one running run."""
    backend = "sqlite" if url.startswith("sqlite") else "postgresql"
    engine = create_engine(store_url(url))
    if backend == "sqlite":
        Path(engine.url.database).parent.mkdir(parents=True, exist_ok=True)
    with engine.begin() as db:
        db.execute(text(
            "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, batch_sizes TEXT NOT NULL, "
            "default_batch_size INTEGER NOT NULL, eta REAL NOT NULL, max_power_w REAL NOT NULL, "
            "beta REAL NOT NULL, created REAL NOT NULL)"
        ))
        db.execute(text(
            f"CREATE TABLE runs ({V1_TABLES[backend]}, job_id TEXT NOT NULL REFERENCES jobs(job_id), "
            "batch_size INTEGER NOT NULL, phase TEXT NOT NULL, status TEXT NOT NULL, "
            "started REAL NOT NULL, finished REAL, time_s REAL, energy_j REAL, num_gpus INTEGER, "
            "cost REAL)"
        ))
        db.execute(text(
            f"INSERT INTO jobs VALUES ('{JOB}', '{json.dumps(SIZES)}', 128, 0.5, 300.0, 2.0, 0.0)"
        ))
        db.execute(text(
            f"INSERT INTO runs (job_id, batch_size, phase, status, started, finished, time_s, "
            f"energy_j, num_gpus, cost) VALUES ('{JOB}', 128, 'prune', 'reached', 1.0, 2.0, "
            f"10.0, 1000.0, 1, 1250.0), ('{JOB}', 64, 'prune', 'running', 3.0, NULL, NULL, NULL, "
            f"NULL, NULL)"
        ))
    engine.dispose()


def test_older_schema_is_migrated(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_v1_store(url)
    with pytest.raises(StoreError, match=f"has store schema 1; migrate it to {SCHEMA_VERSION}"):
        read_states(url)  # read-only inspection never writes
    assert run_command([url, "--migrate"]) == 0
    assert "job nightly-gpt: 2 runs" in capsys.readouterr().out
    (state,) = read_states(url)
    assert state.arms[128].costs == [1250.0]
    assert state.arms[64].expired == 1  # the v1 run never reported: leased from its start
    bso = optimizer(url)
    assert bso.suggest().batch_size == 64


def test_newer_and_foreign_schemas_are_refused(url: str) -> None:
    optimizer(url).close()
    engine = create_engine(store_url(url))
    with engine.begin() as db:
        db.execute(text("UPDATE perseus_meta SET value = '99' WHERE key = 'schema_version'"))
    with pytest.raises(StoreError, match="written by a newer perseus-ext .store schema 99"):
        optimizer(url)
    with engine.begin() as db:
        db.execute(text("DROP TABLE perseus_meta"))
        db.execute(text("DROP TABLE runs"))
        db.execute(text("DROP TABLE jobs"))
        db.execute(text("CREATE TABLE jobs (id INTEGER PRIMARY KEY, name TEXT)"))
    engine.dispose()
    with pytest.raises(StoreError, match="is not a perseus-ext batch-size store: table 'jobs'"):
        optimizer(url)
    with pytest.raises(StoreError, match="is not a perseus-ext batch-size store"):
        read_states(url)


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    batch_size_command.register(parser.add_subparsers())
    args = parser.parse_args(["batch-size", *argv])
    return args.func(args)


def test_cli_reads_either_backend(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    bso = optimizer(url, pruning_rounds=1)
    rng = random.Random(0)
    for _ in range(7):
        suggestion = bso.suggest()
        finish(bso, suggestion.run_id, suggestion.batch_size, rng)
    bso.suggest()
    assert run_command([url]) == 0
    out = capsys.readouterr().out
    assert "job nightly-gpt: 8 runs" in out and "best batch size: 64" in out
    assert run_command([url, "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)
    assert job["best_batch_size"] == 64
    assert {b["batch_size"]: b["status"] for b in job["batch_sizes"]}[512] == "pruned"
