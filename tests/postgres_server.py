"""A throw-away PostgreSQL server on a loopback port, for the batch-size store tests.

The server refuses to run as root, which is what CI and the test machines run as, so under
root it is initialised and started as the unprivileged `postgres` user (created if missing)
through `runuser` or `su`. Debian keeps `initdb` and `pg_ctl` off PATH (in
/usr/lib/postgresql/<version>/bin), so they are looked up there too.

`.ci/run` starts one server for the whole suite (`python tests/postgres_server.py start DIR`
prints its port, `stop DIR` ends it) and hands its port to the tests in
`PERSEUS_TEST_POSTGRES_PORT`; without it the `postgres` fixture starts its own. Where no
server can be had, `start_server` / `server_from_environment` say why: the tests skip with that
reason, except under CI (env CI=true), where they fail -- a CI run never passes without the
real server.
"""

from __future__ import annotations

import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVICE_USER = "postgres"
START_TIMEOUT_S = 60
PORT_VARIABLE = "PERSEUS_TEST_POSTGRES_PORT"
INSTALL = "apt-get install -y postgresql"


class ServerUnavailable(RuntimeError):
    """PostgreSQL cannot be started (or reached) here; the message says why."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tool(name: str) -> str:
    """The PostgreSQL server tool `name`: on PATH, else from the newest Debian install."""
    found = shutil.which(name)
    if found is not None:
        return found
    installed = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                       key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0)
    if not installed:
        raise ServerUnavailable(f"{name} is neither on PATH nor in /usr/lib/postgresql/*/bin ({INSTALL})")
    return installed[-1]


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
    """A running server; `url(db)` is a SQLAlchemy URL of one of its databases. `directory`
    is None for a server someone else started (`.ci/run`): `stop` leaves it running."""

    directory: Path | None
    port: int

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SERVICE_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.directory is not None:
            stop_directory(self.directory)


def stop_directory(directory: Path) -> None:
    """Stop the server whose files are in `directory` (if it runs) and remove them."""
    data = directory / "data"
    try:
        if data.is_dir():
            subprocess.run(
                _as_service_user([_tool("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                capture_output=True,
                timeout=START_TIMEOUT_S,
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def start_server(directory: Path | None = None) -> PostgresServer:
    """initdb + pg_ctl start on a free loopback port, in `directory` (a fresh temporary one by
    default); its files are removed again if it does not start."""
    initdb, pg_ctl = _tool("initdb"), _tool("pg_ctl")
    directory = Path(tempfile.mkdtemp(prefix="perseus-pg-")) if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if os.geteuid() == 0:
            _as_service_user(["true"])  # creates the service user if missing
            shutil.chown(directory, SERVICE_USER)
        data = directory / "data"
        _run([initdb, "-D", str(data), "-A", "trust", "-U", SERVICE_USER, "--no-sync"], "initdb")
        port = _free_port()
        options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        _run(
            [pg_ctl, "-D", str(data), "-o", options, "-l", str(directory / "log"), "-w", "start"],
            "pg_ctl start",
        )
    except (ServerUnavailable, OSError) as err:
        shutil.rmtree(directory, ignore_errors=True)
        raise ServerUnavailable(str(err)) from None
    return PostgresServer(directory, port)


def server_from_environment() -> PostgresServer | None:
    """The server `.ci/run` started (its port in PERSEUS_TEST_POSTGRES_PORT), checked to
    accept connections; None when the variable is not set."""
    value = os.environ.get(PORT_VARIABLE)
    if value is None:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ServerUnavailable(f"{PORT_VARIABLE}={value!r} is not a port number")
    try:
        with socket.create_connection(("127.0.0.1", int(value)), timeout=5.0):
            pass
    except OSError as err:
        raise ServerUnavailable(f"nothing accepts connections on {PORT_VARIABLE}={value}: {err}") from None
    return PostgresServer(None, int(value))


def main(argv: list[str]) -> int:
    """`start DIR`: start a server in DIR and print its port; `stop DIR`: stop it, remove DIR."""
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: postgres_server.py {start,stop} DIR", file=sys.stderr)
        return 2
    action, directory = argv[0], Path(argv[1])
    if action == "stop":
        stop_directory(directory)
        return 0
    try:
        server = start_server(directory)
    except ServerUnavailable as err:
        print(f"postgres_server.py: error: PostgreSQL did not start: {err}", file=sys.stderr)
        return 1
    print(server.port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
