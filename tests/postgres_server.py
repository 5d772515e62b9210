"""A throw-away PostgreSQL server on a loopback port, for the batch-size store tests.

The server refuses to run as root, which is what CI and the test machines run as, so under
root it is initialised and started as the unprivileged `postgres` user (created if missing)
through `runuser` or `su`. Where it cannot start, `start_server` says why and the tests skip
with that reason: they never pass silently.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVICE_USER = "postgres"
START_TIMEOUT_S = 60


class ServerUnavailable(RuntimeError):
    """PostgreSQL cannot be started here; the message is the skip reason."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_service_user(command: list[str]) -> list[str]:
    """`command` run as the unprivileged service user when we are root, else as ourselves."""
    if os.geteuid() != 0:
        return command
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        created = subprocess.run(
            ["useradd", "--system", "--no-create-home", SERVICE_USER],
            capture_output=True,
            text=True,
        )
        if created.returncode != 0:
            raise ServerUnavailable(
                f"running as root and cannot create user {SERVICE_USER!r}: {created.stderr.strip()}"
            ) from None
    if shutil.which("runuser"):
        return ["runuser", "-u", SERVICE_USER, "--", *command]
    return ["su", SERVICE_USER, "-s", "/bin/sh", "-c", shlex.join(command)]


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            _as_service_user(command), capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServerUnavailable(f"{what} failed: {err}") from None
    if done.returncode != 0:
        raise ServerUnavailable(f"{what} failed: {(done.stderr or done.stdout).strip()[-500:]}")


@dataclass
class PostgresServer:
    """A running server; `url(db)` is a SQLAlchemy URL of one of its databases."""

    directory: Path
    port: int

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SERVICE_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        subprocess.run(
            _as_service_user(["pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "stop"]),
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
        shutil.rmtree(self.directory, ignore_errors=True)


def start_server() -> PostgresServer:
    """initdb + pg_ctl start on a free loopback port, in a fresh directory."""
    for tool in ("initdb", "pg_ctl"):
        if shutil.which(tool) is None:
            raise ServerUnavailable(f"{tool} is not on PATH (install PostgreSQL, e.g. Debian's postgresql)")
    directory = Path(tempfile.mkdtemp(prefix="perseus-pg-"))
    if os.geteuid() == 0:
        _as_service_user(["true"])  # creates the service user if missing
        shutil.chown(directory, SERVICE_USER)
    data = directory / "data"
    try:
        _run(["initdb", "-D", str(data), "-A", "trust", "-U", SERVICE_USER, "--no-sync"], "initdb")
        port = _free_port()
        options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        _run(
            ["pg_ctl", "-D", str(data), "-o", options, "-l", str(directory / "log"), "-w", "start"],
            "pg_ctl start",
        )
    except ServerUnavailable:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return PostgresServer(directory, port)
