"""Where the batch-size optimizer keeps its state: one SQL database addressed by a URL.

* A local path or ``sqlite:///path`` is an embedded SQLite file (the default, one host). Every
  write is one ``BEGIN IMMEDIATE`` transaction in WAL mode, so concurrent processes serialise.
  SQLite's locking is unreliable on network file systems, so a job whose runs start on
  different nodes should use a server.
* ``postgresql://user:password@host:port/db`` is a PostgreSQL server (SQLAlchemy 2 + psycopg 3).
  Writers of one job serialise on its row (``SELECT ... FOR UPDATE``); schema creation and
  migration hold a transaction-scoped advisory lock.

Either way a transaction either commits whole or not at all: a process killed in the middle
(SIGKILL) leaves no half-written run, and its locks go with its connection. The schema carries
a version number; a store written by an older version is migrated on first write, a newer or
foreign one is refused with a message that says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from sqlalchemy import (
    Column,
    Connection,
    Double,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    inspect,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError

from perseus_ext.config.policy import DEFAULT_NETWORK_TIMEOUT_S
from perseus_ext.config.policy import MAX_STORE_LOCATION_CHARS as MAX_LOCATION_CHARS
from perseus_ext.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert

#: Version 1: jobs + runs (perseus-ext 0.1, SQLite only). Version 2 adds the run lease
#: (`heartbeat`, `lease_s`) that expires crashed runs, and this version table.
SCHEMA_VERSION = 2
STORE_KEY = "perseus.policy.batch_size.store"
TIMEOUT_KEY = "perseus.policy.batch_size.timeout_s"
#: Any constant: the PostgreSQL advisory lock that serialises schema creation and migration.
_SCHEMA_LOCK_ID = 0x5045525345
_SQLITE_LOCKED_RETRY_S = 0.01
#: Lease given to runs migrated from a v1 store, which recorded no heartbeat (seconds).
DEFAULT_V1_LEASE_S = 3600.0

metadata = MetaData()
meta_table = Table(
    "perseus_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)
jobs_table = Table(
    "jobs",
    metadata,
    Column("job_id", String(255), primary_key=True),
    Column("batch_sizes", Text, nullable=False),
    Column("default_batch_size", Integer, nullable=False),
    Column("eta", Double, nullable=False),
    Column("max_power_w", Double, nullable=False),
    Column("beta", Double, nullable=False),
    Column("created", Double, nullable=False),
)
runs_table = Table(
    "runs",
    metadata,
    Column("run_id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(255), ForeignKey("jobs.job_id"), nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("phase", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("started", Double, nullable=False),
    Column("finished", Double),
    Column("time_s", Double),
    Column("energy_j", Double),
    Column("num_gpus", Integer),
    Column("cost", Double),
    Column("heartbeat", Double),
    Column("lease_s", Double),
)
Index("runs_by_job", runs_table.c.job_id, runs_table.c.batch_size)

_V1_COLUMNS = {
    "jobs": {c.name for c in jobs_table.columns},
    "runs": {c.name for c in runs_table.columns} - {"heartbeat", "lease_s"},
}


class StoreError(ConfigError):
    """The batch-size store cannot be used: bad URL, unreachable server, foreign schema."""


def store_url(location: str | Path) -> str:
    """The SQLAlchemy URL of a store location: a path, ``sqlite:///path`` or ``postgresql://``."""
    text_location = str(location)
    if "\0" in text_location or len(text_location) > MAX_LOCATION_CHARS:
        raise StoreError(f"{STORE_KEY}: {text_location[:60]!r}{'...' * (len(text_location) > 60)} is not a path or URL "
                         f"(a NUL byte, or longer than {MAX_LOCATION_CHARS} characters)")
    if isinstance(location, Path) or "://" not in text_location:
        path = Path(text_location).expanduser().resolve()
        return f"sqlite:///{path}"
    try:
        url = make_url(text_location)
    except (ArgumentError, ValueError):  # ValueError: a malformed port ("postgresql://u@[::1/db")
        raise StoreError(
            f"{STORE_KEY}: {text_location!r} is not a URL; use a path, sqlite:///path or "
            f"postgresql://user:password@host:port/db"
        ) from None
    backend = url.get_backend_name()
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise StoreError(
                f"{STORE_KEY}: {text_location!r} names no file; an in-memory SQLite store would "
                f"forget every run, use sqlite:///path/to/bso.db"
            )
        return url.render_as_string(hide_password=False)
    if backend in ("postgresql", "postgres"):
        return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise StoreError(
        f"{STORE_KEY}: unsupported database {backend!r} in {_printable(url.render_as_string())}; use a path, "
        f"sqlite:///path or postgresql://user:password@host:port/db"
    )


def _one_line(err: Exception) -> str:
    """A driver's error on one line (libpq's run over several, with hints)."""
    return " ".join(str(getattr(err, "orig", None) or err).split())


def describe(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return _printable(make_url(url).render_as_string(hide_password=True))


def _printable(text: object) -> str:
    """`text` for a one-line message: as it is, or quoted with escapes where it holds a newline
    or another unprintable character (a store location as the user typed it)."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def _unlockable(path: Path) -> bool:
    """Whether a read-only reader must open the WAL-mode file without its shared-memory lock
    file: another user's store, in a folder this user may not write, whose `-wal` is gone (the
    last writer checkpointed it into the file and removed it). SQLite would have to create the
    `-shm` file to read it ("attempt to write a readonly database"); with no `-wal` the file
    holds every committed run, so reading it as immutable is exact."""
    wal = path.with_name(path.name + "-wal")
    return not os.access(path.parent, os.W_OK) and not wal.exists()


class Store:
    """One process's handle on a batch-size store. Thread-safe; reopens itself after a fork."""

    def __init__(self, location: str | Path, *, read_only: bool = False, busy_timeout_s: float = 60.0,
                 network_timeout_s: float = DEFAULT_NETWORK_TIMEOUT_S, timeout_key: str = TIMEOUT_KEY):
        self.url = store_url(location)
        self.is_sqlite = make_url(self.url).get_backend_name() == "sqlite"
        self.read_only = read_only
        self.busy_timeout_s = busy_timeout_s  # SQLite: how long a writer waits for the file's lock
        self.network_timeout_s = network_timeout_s  # PostgreSQL: connect, unanswered TCP
        self.timeout_key = timeout_key  # what sets network_timeout_s (named when it runs out)
        self._engine_lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_pid = 0
        if read_only:
            self._check_schema_read_only()
        else:
            self._create_or_migrate()

    @property
    def name(self) -> str:
        return describe(self.url)

    # ------------------------------------------------------------------ engine
    def engine(self) -> Engine:
        """This process's engine (a forked child must not share its parent's connections)."""
        with self._engine_lock:
            if self._engine is None or self._engine_pid != os.getpid():
                if self._engine is not None:
                    self._engine.dispose(close=False)
                self._engine = self._make_engine()
                self._engine_pid = os.getpid()
            return self._engine

    def _make_engine(self) -> Engine:
        if not self.is_sqlite:
            milliseconds = max(1, round(1000 * self.network_timeout_s))
            return create_engine(
                self.url,
                pool_pre_ping=True,
                connect_args={
                    "connect_timeout": max(2, math.ceil(self.network_timeout_s)),  # libpq's least is 2 s
                    "tcp_user_timeout": milliseconds,  # sent data left unacknowledged
                    "keepalives": 1, "keepalives_idle": max(1, math.ceil(self.network_timeout_s)),
                    "keepalives_interval": 1, "keepalives_count": 3,  # a host gone: noticed in seconds
                },
            )
        path = Path(make_url(self.url).database or "")
        shown = _printable(path)
        if self.read_only:
            try:
                path.stat()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    raise StoreError(f"batch-size store {shown}: {err.strerror}; check {STORE_KEY}") from None
            if path.is_dir():
                raise StoreError(f"batch-size store {shown} is a directory, not a store file; give the store's "
                                 f"file (e.g. {_printable(path / 'bso.db')}) in {STORE_KEY}")
            if not path.is_file():
                raise StoreError(f"batch-size store {shown} does not exist; check {STORE_KEY}")
            url = f"sqlite:///file:{path}?mode=ro{'&immutable=1' * _unlockable(path)}&uri=true"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            url = self.url
        engine = create_engine(
            url, connect_args={"timeout": self.busy_timeout_s, "check_same_thread": False}
        )
        event.listen(engine, "connect", self._on_sqlite_connect)
        event.listen(engine, "begin", self._on_sqlite_begin)
        return engine

    def _on_sqlite_connect(self, dbapi_connection, _record) -> None:  # noqa: ANN001 (DB-API)
        """Let SQLAlchemy's `begin` event issue BEGIN (the driver's own would be deferred), and
        switch a writable file to WAL so readers never block writers."""
        dbapi_connection.isolation_level = None
        if self.read_only:
            return
        deadline = time.monotonic() + self.busy_timeout_s
        while True:  # "locked" comes at once, without the busy handler, while another
            try:  # process creates the file or switches it to WAL at the same moment
                dbapi_connection.execute("PRAGMA journal_mode=WAL")
                break
            except Exception as err:  # sqlite3.OperationalError, without importing sqlite3
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(_SQLITE_LOCKED_RETRY_S)
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")  # WAL stays consistent

    def _on_sqlite_begin(self, connection: Connection) -> None:
        """IMMEDIATE takes the write lock up front: two writers never both read stale state."""
        connection.exec_driver_sql("BEGIN" if self.read_only else "BEGIN IMMEDIATE")

    def insert(self, table: Table) -> "Insert":
        """The backend's INSERT, which has ON CONFLICT DO NOTHING (atomic insert-if-absent)."""
        if self.is_sqlite:
            return sqlite_insert(table)
        return postgresql_insert(table)

    def close(self) -> None:
        """Close this process's connections (they reopen on the next call)."""
        with self._engine_lock:
            if self._engine is not None and self._engine_pid == os.getpid():
                self._engine.dispose()
            self._engine = None

    # ------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self, job_id: str | None = None) -> Iterator[Connection]:
        """One atomic transaction; with `job_id` (PostgreSQL) the job's row is locked first,
        so read-modify-writes of one job serialise across hosts."""
        try:
            with self.engine().begin() as connection:
                if job_id is not None and not self.is_sqlite:
                    connection.execute(
                        select(jobs_table.c.job_id)
                        .where(jobs_table.c.job_id == job_id)
                        .with_for_update()
                    )
                yield connection
        except OperationalError as err:
            raise StoreError(f"batch-size store {self.name} is unavailable: {_one_line(err)}{self._timeout_hint(err)}"
                             ) from err

    def _timeout_hint(self, err: Exception) -> str:
        """Which setting bounded the wait, when it ran out."""
        if self.is_sqlite or "timeout" not in str(err).lower():
            return ""
        return f" (no answer within {self.timeout_key} = {self.network_timeout_s:g} s)"

    # ------------------------------------------------------------------ schema
    def _version(self, connection: Connection) -> int | None:
        """The schema version found: None for an empty database, 1 for perseus-ext 0.1's
        tables; StoreError for tables that are not a batch-size store."""
        tables = set(inspect(connection).get_table_names())
        if meta_table.name in tables:
            row = connection.execute(
                select(meta_table.c.value).where(meta_table.c.key == "schema_version")
            ).first()
            if row is None or not str(row[0]).isdigit():
                raise StoreError(f"{self.name}: {meta_table.name} has no schema_version")
            return int(row[0])
        ours = set(_V1_COLUMNS) & tables
        if not ours:
            return None
        for table in ours:
            columns = {c["name"] for c in inspect(connection).get_columns(table)}
            if not _V1_COLUMNS[table] <= columns or ours != set(_V1_COLUMNS):
                raise StoreError(
                    f"{self.name} is not a perseus-ext batch-size store: table {table!r} has "
                    f"columns {sorted(columns)}; point {STORE_KEY} at a new database or file"
                )
        return 1

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.name} was written by a newer perseus-ext (store schema {version}, this "
                f"one reads up to {SCHEMA_VERSION}); upgrade perseus-ext on this node"
            )

    def _create_or_migrate(self) -> None:
        try:
            with self.transaction() as connection:
                if not self.is_sqlite:
                    connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _SCHEMA_LOCK_ID})
                version = self._version(connection)
                if version is None:
                    metadata.create_all(connection)
                    connection.execute(
                        meta_table.insert().values(key="schema_version", value=str(SCHEMA_VERSION))
                    )
                    return
                self._check_version(version)
                if version == 1:
                    self._migrate_v1(connection)
        except SQLAlchemyError as err:
            raise StoreError(f"cannot open batch-size store {self.name}: {_one_line(err)}{self._timeout_hint(err)}"
                             ) from None

    def _migrate_v1(self, connection: Connection) -> None:
        """v1 -> v2: add the lease columns; a v1 run still 'running' gets a lease from its
        start, so a run that crashed under v1 expires like any other."""
        connection.exec_driver_sql("ALTER TABLE runs ADD COLUMN heartbeat DOUBLE PRECISION")
        connection.exec_driver_sql("ALTER TABLE runs ADD COLUMN lease_s DOUBLE PRECISION")
        connection.execute(
            runs_table.update().values(heartbeat=runs_table.c.started, lease_s=DEFAULT_V1_LEASE_S)
        )
        meta_table.create(connection)
        connection.execute(
            meta_table.insert().values(key="schema_version", value=str(SCHEMA_VERSION))
        )

    def _check_schema_read_only(self) -> None:
        try:
            with self.transaction() as connection:
                version = self._version(connection)
        except SQLAlchemyError as err:
            raise StoreError(
                f"{self.name} is not a perseus-ext batch-size store ({_one_line(err)})"
            ) from None
        if version is None:
            raise StoreError(f"{self.name} is not a perseus-ext batch-size store (no jobs table)")
        self._check_version(version)
        if version < SCHEMA_VERSION:
            raise StoreError(
                f"{self.name} has store schema {version}; migrate it to {SCHEMA_VERSION} with "
                f"`perseus-ext batch-size {self.name} --migrate` (or by starting any run)"
            )
