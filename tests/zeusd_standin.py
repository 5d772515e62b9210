"""A stand-in for zeusd (ml-energy/zeus `zeusd/`, API in `docs/zeusd/api.md`) for the tests.

It follows the daemon's documented HTTP API and what its source does where the docs are terse:

* `GET /discover` and `GET /time` always answer, without auth; `/discover` lists GPUs with
  `pci_address` and `cumulative_energy_available` (zeusd after 0.5) or only `id` and `name`
  (`version="0.5"`).
* The auth middleware (`src/auth.rs`): a path whose API group is not enabled is 404 `{"error":
  "API group '<g>' is not enabled on this server."}` whatever the token; without a signing key
  `/auth/*` is 404; with one, a missing bearer is 401, a bad or expired JWT (HS256) 401, a token
  without the path's scope (`/gpu/set_*`, `/gpu/reset_*` need `gpu-control`) 403 naming the user
  and its scopes.
* Writes (`src/routes/gpu.rs`): query fields are `gpu_ids` + the command's fields + `block`, all
  required, unknown ones refused (400 "Query deserialize error: ..." as actix words it); an empty
  or malformed `gpu_ids` is 400 `{"error": ...}`, an index out of range 400 "GPU index N does not
  exist."; `block=true` runs the command and aggregates per-GPU failures into `{"errors":
  {"<id>": "<message>"}}` with the worst status; `block=false` queues it and answers 200 at once
  (execution errors are not reported, as the docs say).

The "GPUs" are simulated GPUs' persisted state files (`SimulatedGPU(state_file=...)`), which this
stand-in, playing the root daemon, changes; the training process's unprivileged simulated GPU
follows them (`follow_external_change`), as a real GPU follows what zeusd's NVML calls did. Faults
for tests: `hang()` (requests block until `release()`), `kill()` (stops listening, leaves a stale
socket file: connection refused), `stop()` (removes the socket, as a clean zeusd exit does).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jwt

from perseus_ext.measurement.gpu.common import GPUError
from perseus_ext.measurement.gpu.sim import SimulatedGPU

ALL_GROUPS = ("gpu-control", "gpu-read", "cpu-read")
WRITE_FIELDS = {
    "set_gpu_locked_clocks": ("min_clock_mhz", "max_clock_mhz"),
    "reset_gpu_locked_clocks": (),
    "reset_locked_clocks": (),
    "set_power_limit": ("power_limit_mw",),
}


@dataclass(frozen=True)
class StandinGPU:
    """One GPU the daemon serves: its zeusd index, PCI address and simulated state."""

    id: int
    pci_address: str
    state_file: Path
    preset: str = "a100_sxm"
    name: str = "NVIDIA A100-SXM4-80GB"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    user: str | None


@dataclass
class ZeusdStandin:
    """A zeusd stand-in on a Unix socket (`socket_path`) or a loopback TCP port (`tcp=True`)."""

    gpus: list[StandinGPU]
    socket_path: Path | None = None
    tcp: bool = False
    enabled: tuple[str, ...] = ALL_GROUPS
    signing_key: bytes | None = None
    version: str = "head"
    requests: list[Request] = field(default_factory=list)
    async_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._hang = threading.Event()
        self._released = threading.Event()
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None
        self._queues: dict[int, queue.SimpleQueue[Any]] = {}
        self._lock = threading.Lock()
        self._gpu_locks = [threading.Lock() for _ in self.gpus]  # zeusd runs one GPU's commands in order
        self.connections: set[Any] = set()  # open client connections (keep-alive), cut when it dies

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "ZeusdStandin":
        handler = _handler_for(self)
        if self.tcp:
            self._server = _TCPHTTPServer(("127.0.0.1", 0), handler)
        else:
            assert self.socket_path is not None
            self.socket_path.unlink(missing_ok=True)
            self._server = _UnixHTTPServer(str(self.socket_path), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="zeusd-standin", daemon=True)
        self._thread.start()
        return self

    @property
    def env(self) -> dict[str, str]:
        """The variables a job sets to use this daemon."""
        if self.tcp:
            assert self._server is not None
            host, port = self._server.server_address[:2]
            return {"ZEUSD_HOST_PORT": f"{host}:{port}"}
        return {"ZEUSD_SOCK_PATH": str(self.socket_path)}

    def kill(self) -> None:
        """Stop answering like a crashed daemon: the socket file stays, nobody listens."""
        self._release_and_close()

    def stop(self) -> None:
        """Stop like a cleanly exiting daemon (the socket file is removed)."""
        self._release_and_close()
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)

    def _release_and_close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            connections, self.connections = list(self.connections), set()
        for connection in connections:  # a dead daemon's kept-alive connections die with it
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for work in self._queues.values():
            work.put(None)

    def hang(self) -> None:
        """From now on every request blocks (a hung daemon) until release() or stop()."""
        self._released.clear()
        self._hang.set()

    def release(self) -> None:
        self._hang.clear()
        self._released.set()

    def token(self, user: str, scopes: list[str], expires_in_s: float | None = None) -> str:
        """What `zeusd token issue --user U --scope S --expires ...` prints (HS256 JWT)."""
        assert self.signing_key is not None
        claims: dict[str, Any] = {"sub": user, "scopes": scopes}
        if expires_in_s is not None:
            claims["exp"] = int(time.time() + expires_in_s)
        return jwt.encode(claims, self.signing_key, algorithm="HS256")

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST"]

    def locked_clock(self, gpu_id: int) -> int | None:
        return _open(self.gpus[gpu_id]).locked_sm_clock()

    # ------------------------------------------------------------------ request handling
    def handle(self, method: str, target: str, authorization: str | None) -> tuple[int, Any]:
        if self._hang.is_set():
            self._released.wait(60)
        parts = urlsplit(target)
        path = parts.path
        query_pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = dict(query_pairs)
        refusal, user = self._authorize(path, authorization)
        with self._lock:
            self.requests.append(Request(method, path, query, user))
        if refusal is not None:
            return refusal
        if method == "GET" and path == "/discover":
            return 200, self._discovery()
        if method == "GET" and path == "/time":
            return 200, {"timestamp_ms": int(time.time() * 1000)}
        if method == "GET" and path == "/auth/whoami":
            return 200, self._whoami(authorization)
        if method == "POST" and path.startswith("/gpu/") and path[5:] in WRITE_FIELDS:
            return self._write(path[5:], query_pairs)
        if method == "GET" and path == "/gpu/get_power_limit":
            return 200, {str(g.id): {"power_limit_mw": int(_open(g).power_limit_w() * 1000)} for g in self.gpus}
        return 404, ""

    def _authorize(self, path: str, authorization: str | None) -> tuple[tuple[int, Any] | None, str | None]:
        scope = _required_scope(path)
        if scope is not None and scope not in self.enabled:
            return (404, {"error": f"API group '{scope}' is not enabled on this server."}), None
        if self.signing_key is None:
            if path.startswith("/auth/"):
                return (404, {"error": "Authentication is not enabled on this server."}), None
            return None, None
        if path in ("/discover", "/time"):
            return None, None
        if not authorization or not authorization.startswith("Bearer "):
            return (401, {"error": "Authentication required. Provide an Authorization: Bearer <token> header."}), None
        try:
            claims = jwt.decode(authorization[len("Bearer "):], self.signing_key, algorithms=["HS256"],
                                options={"require": []})
        except jwt.ExpiredSignatureError:
            return (401, {"error": "Token has expired."}), None
        except jwt.InvalidTokenError as err:
            return (401, {"error": f"Invalid token: {err}"}), None
        user, scopes = claims.get("sub", ""), list(claims.get("scopes", []))
        if scope is not None and scope not in scopes:
            listed = ", ".join(f"'{s}'" for s in scopes)
            return (403, {"error": f"Token for user '{user}' lacks required scope '{scope}'. "
                                   f"Token scopes: [{listed}]"}), user
        return None, user

    def _discovery(self) -> dict[str, Any]:
        gpus = []
        for gpu in self.gpus:
            entry: dict[str, Any] = {"id": gpu.id, "name": gpu.name}
            if self.version != "0.5":
                entry.update(pci_address=gpu.pci_address, cumulative_energy_available=True)
            gpus.append(entry)
        return {"gpus": gpus, "cpus": [], "enabled_api_groups": list(self.enabled),
                "auth_required": self.signing_key is not None}

    def _whoami(self, authorization: str | None) -> dict[str, Any]:
        assert authorization is not None and self.signing_key is not None
        claims = jwt.decode(authorization[len("Bearer "):], self.signing_key, algorithms=["HS256"],
                            options={"require": []})
        return {key: claims[key] for key in ("sub", "scopes", "exp") if key in claims}

    def _write(self, command: str, pairs: list[tuple[str, str]]) -> tuple[int, Any]:
        expected = ("gpu_ids", *WRITE_FIELDS[command], "block")
        names = [name for name, _ in pairs]
        for name in names:
            if name not in expected:
                return 400, f"Query deserialize error: unknown field `{name}`, expected one of {expected}"
        for name in expected:
            if name not in names:
                return 400, f"Query deserialize error: missing field `{name}`"
        query = dict(pairs)
        try:
            values = {name: int(query[name]) for name in WRITE_FIELDS[command]}
        except ValueError as err:
            return 400, f"Query deserialize error: {err}"
        if query["block"] not in ("true", "false"):
            return 400, "Query deserialize error: provided string was not `true` or `false`"
        ids, problem = _parse_ids(query["gpu_ids"])
        if problem is not None:
            return 400, {"error": problem}
        for gpu_id in ids:
            if gpu_id >= len(self.gpus):
                return 400, f"GPU index {gpu_id} does not exist."
        if query["block"] == "false":
            for gpu_id in ids:
                self._queue(gpu_id).put((command, values))
            return 200, ""
        errors = {}
        for gpu_id in ids:
            with self._gpu_locks[gpu_id]:
                failure = _apply(self.gpus[gpu_id], command, values)
            if failure is not None:
                errors[str(gpu_id)] = failure
        return (400, {"errors": errors}) if errors else (200, "")

    def _queue(self, gpu_id: int) -> queue.SimpleQueue[Any]:
        """zeusd's per-GPU management task: commands run in order, off the request."""
        with self._lock:
            if gpu_id not in self._queues:
                work: queue.SimpleQueue[Any] = queue.SimpleQueue()
                self._queues[gpu_id] = work
                threading.Thread(target=self._drain, args=(gpu_id, work), daemon=True).start()
            return self._queues[gpu_id]

    def _drain(self, gpu_id: int, work: queue.SimpleQueue[Any]) -> None:
        while (item := work.get()) is not None:
            with self._gpu_locks[gpu_id]:
                failure = _apply(self.gpus[gpu_id], *item)
            if failure is not None:
                self.async_errors.append(failure)


def _apply(gpu: StandinGPU, command: str, values: dict[str, int]) -> str | None:
    """Run one command on the simulated GPU as root would; the NVML-style error, None if done."""
    device = _open(gpu)
    try:
        if command == "set_gpu_locked_clocks":
            if values["min_clock_mhz"] != values["max_clock_mhz"]:
                return "NVML error: Invalid Argument"  # the simulator locks one clock only
            device.set_locked_sm_clocks(values["min_clock_mhz"])
        elif command in ("reset_gpu_locked_clocks", "reset_locked_clocks"):
            device.reset_locked_sm_clocks()
        elif command == "set_power_limit":
            device.set_power_limit_w(values["power_limit_mw"] / 1000)
    except GPUError:
        return "NVML error: Invalid Argument"
    return None


def _open(gpu: StandinGPU) -> SimulatedGPU:
    return SimulatedGPU(gpu.preset, state_file=gpu.state_file, pace=False)


def _parse_ids(raw: str) -> tuple[list[int], str | None]:
    if not raw.strip():
        return [], "gpu_ids must contain at least one GPU index"
    ids = []
    for part in raw.split(","):
        if not part.strip():
            return [], "gpu_ids contains an empty GPU index"
        if not part.strip().isdigit():
            return [], f"Invalid GPU index: {part.strip()}"
        ids.append(int(part))
    return sorted(set(ids)), None


def _required_scope(path: str) -> str | None:
    if path in ("/discover", "/time"):
        return None
    if path.startswith(("/gpu/set_", "/gpu/reset_")):
        return "gpu-control"
    if path.startswith("/gpu/"):
        return "gpu-read"
    if path.startswith("/cpu/"):
        return "cpu-read"
    return None


class _QuietAboutGoneClients:
    """A client that gave up (its read timeout ran out while the daemon hung) is no error of
    the daemon's; anything else is reported as socketserver does."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)  # type: ignore[misc]


class _UnixHTTPServer(_QuietAboutGoneClients, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TCPHTTPServer(_QuietAboutGoneClients, ThreadingHTTPServer):
    pass


def _handler_for(daemon: ZeusdStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with daemon._lock:
                daemon.connections.add(self.connection)

        def finish(self) -> None:
            with daemon._lock:
                daemon.connections.discard(self.connection)
            super().finish()

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, body = daemon.handle(self.command, self.path, self.headers.get("Authorization"))
            if isinstance(body, (dict, list)):
                data, kind = json.dumps(body).encode(), "application/json"
            else:
                data, kind = str(body).encode(), "text/plain; charset=utf-8"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def address_string(self) -> str:  # a Unix socket peer has no address
            return "unix"

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def standin_gpus(directory: Path, count: int, *, order: list[int] | None = None) -> list[StandinGPU]:
    """GPUs for simulated ranks 0..count-1 (rank r sits at PCI bus r + 1, state file
    sim-gpu-rank<r>.json); `order` lists which rank's GPU gets zeusd index 0, 1, ..., so a test
    can number them differently from the ranks, as a real node does."""
    order = list(range(count)) if order is None else order
    return [StandinGPU(index, f"0000:{rank + 1:02x}:00.0", directory / f"sim-gpu-rank{rank}.json")
            for index, rank in enumerate(order)]


def reader_spec(directory: Path, **options: str) -> str:
    """The simulated GPU a non-root rank reads from (its state file is the stand-in's GPU)."""
    query = "&".join(f"{k}={v}" for k, v in {"privileged": "0", "state_file":
                                                str(directory / "sim-gpu-rank{rank}.json"), **options}.items())
    return f"sim:a100_sxm?{query}"


def socket_in(directory: Path) -> Path:
    """A Unix socket path short enough for sun_path (108 bytes) even in deep temp dirs."""
    path = directory / "zeusd.sock"
    if len(os.fsencode(path)) < 100:
        return path
    import tempfile

    return Path(tempfile.mkdtemp(prefix="zeusd-")) / "zeusd.sock"
