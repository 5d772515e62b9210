"""A client for zeusd, the Zeus project's privileged GPU daemon, over its documented HTTP API.

On clusters the trainer is not root, so NVML refuses to change clocks. zeusd (ml-energy/zeus,
`zeusd/`, API in `docs/zeusd/api.md`) runs as root on the node and exposes the writes over HTTP
on a Unix socket (`ZEUSD_SOCK_PATH`) or TCP (`ZEUSD_HOST_PORT`), optionally behind JWT bearer
tokens (`ZEUSD_TOKEN`) whose scopes name API groups (`gpu-control` for every `/gpu/set_*` and
`/gpu/reset_*`). This module speaks that API with httpx and turns each way it can fail into one
`ZeusdError` whose message says what is wrong and what to do: no daemon at the socket, a refused
connection, a daemon that hangs (bounded connect/read timeouts), 401/403 (missing token or scope),
a daemon started without `gpu-control`, and the daemon's own per-GPU errors.

Only writes go through zeusd: reads (energy counter, power, supported clocks) stay on NVML, which
needs no privilege, so measurement never pays an HTTP round trip.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import httpx

from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu.common import GPUError

ENV_SOCK_PATH = "ZEUSD_SOCK_PATH"
ENV_HOST_PORT = "ZEUSD_HOST_PORT"
ENV_TOKEN = "ZEUSD_TOKEN"
CONTROL_SCOPE = "gpu-control"  # zeusd's API group (and token scope) of every GPU write
CONNECT_TIMEOUT_S = 1.0  # a daemon that is there accepts at once; longer means it is not
READ_TIMEOUT_S = 2.0  # a blocking write is one NVML call (10-20 ms); seconds mean a hung daemon
ROUND_TRIP_SAMPLES = 5  # GET /time calls whose median is the start-up round-trip estimate
ROUND_TRIPS_KEPT = 10_000  # write round trips kept for the summary's median and p99
TOKEN_HELP = (
    "ask the node's operator for a token with scope 'gpu-control' (`zeusd token issue "
    "--signing-key-path <key> --user <you> --scope gpu-control --expires 30d`) and export it as "
    f"{ENV_TOKEN}"
)


class _QuietZeusdRequests(logging.Filter):
    """httpx logs every request at INFO; one per clock change would flood a training log."""

    def __init__(self) -> None:
        super().__init__()
        self.prefixes: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("HTTP Request:") and any(p in message for p in self.prefixes))


_QUIET = _QuietZeusdRequests()
logging.getLogger("httpx").addFilter(_QUIET)


class ZeusdError(GPUError):
    """A call to zeusd failed; the message names the daemon, the call and the fix."""


class ZeusdUnreachableError(ZeusdError):
    """No daemon answers: no socket, connection refused, or no answer within the timeout."""


class ZeusdAuthError(ZeusdError):
    """The daemon refused the token (401) or its scopes (403)."""


class ZeusdCapabilityError(ZeusdError):
    """The daemon cannot do what perseus-ext needs (gpu-control disabled, GPU not served)."""


@dataclass(frozen=True)
class ZeusdEndpoint:
    """Where zeusd listens: a Unix socket path or a TCP host:port (exactly one)."""

    socket_path: str | None = None
    host_port: str | None = None

    def __post_init__(self) -> None:
        if (self.socket_path is None) == (self.host_port is None):
            raise ConfigError("a zeusd endpoint is a Unix socket path or a host:port, exactly one")
        if self.host_port is not None:
            host, _, port = self.host_port.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{ENV_HOST_PORT}={self.host_port!r} must be host:port, e.g. 127.0.0.1:4938")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZeusdEndpoint | None:
        """ZEUSD_SOCK_PATH first, then ZEUSD_HOST_PORT (Zeus's own order); None if neither is set."""
        environ = os.environ if environ is None else environ
        if environ.get(ENV_SOCK_PATH, "").strip():
            return cls(socket_path=environ[ENV_SOCK_PATH].strip())
        if environ.get(ENV_HOST_PORT, "").strip():
            return cls(host_port=environ[ENV_HOST_PORT].strip())
        return None

    @property
    def variable(self) -> str:
        return ENV_SOCK_PATH if self.socket_path is not None else ENV_HOST_PORT

    def describe(self) -> str:
        where = self.socket_path if self.socket_path is not None else self.host_port
        return f"zeusd at {where} ({self.variable})"

    def base_url(self) -> str:
        return "http://zeusd" if self.socket_path is not None else f"http://{self.host_port}"


@dataclass(frozen=True)
class ZeusdGpuInfo:
    """One GPU of `GET /discover`; pci_address is absent from zeusd 0.5 and older."""

    id: int
    name: str
    pci_address: str | None


@dataclass(frozen=True)
class ZeusdDiscovery:
    """`GET /discover`: the daemon's GPUs, enabled API groups and whether it wants tokens."""

    gpus: tuple[ZeusdGpuInfo, ...]
    enabled_api_groups: frozenset[str]
    auth_required: bool


@dataclass
class ZeusdCallStats:
    """What the writes cost and how many failed, for the run summary."""

    writes: int = 0
    failures: int = 0
    last_error: str | None = None
    round_trips_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=ROUND_TRIPS_KEPT))

    def summary(self) -> dict[str, Any]:
        trips = sorted(self.round_trips_s)
        return {
            "writes": self.writes,
            "failures": self.failures,
            "last_error": self.last_error,
            "round_trip_ms_median": 1000 * statistics.median(trips) if trips else None,
            "round_trip_ms_p99": 1000 * trips[min(len(trips) - 1, int(0.99 * len(trips)))] if trips else None,
        }


class ZeusdClient:
    """The HTTP calls perseus-ext makes to zeusd, each bounded by the connect/read timeouts."""

    def __init__(self, endpoint: ZeusdEndpoint, token: str | None, *,
                 connect_timeout_s: float | None = None, read_timeout_s: float | None = None) -> None:
        """Timeouts default to CONNECT_TIMEOUT_S / READ_TIMEOUT_S (read when the client is made)."""
        self.endpoint = endpoint
        self.token = token or None
        connect_timeout_s = CONNECT_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
        read_timeout_s = READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        self.read_timeout_s = read_timeout_s
        self.stats = ZeusdCallStats()
        self._lock = threading.Lock()  # stats are written by the worker and the closing thread
        _QUIET.prefixes.add(endpoint.base_url())
        transport = httpx.HTTPTransport(uds=endpoint.socket_path) if endpoint.socket_path else None
        self._http = httpx.Client(
            base_url=endpoint.base_url(), transport=transport, trust_env=False,
            headers={"Authorization": f"Bearer {self.token}"} if self.token else {},
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
        )

    # ------------------------------------------------------------------ calls
    def discover(self) -> ZeusdDiscovery:
        data = self._json(self._request("GET", "/discover", "read /discover"), "/discover")
        try:
            gpus = tuple(ZeusdGpuInfo(int(gpu["id"]), str(gpu.get("name", "")), gpu.get("pci_address"))
                         for gpu in data["gpus"])
            return ZeusdDiscovery(gpus, frozenset(map(str, data["enabled_api_groups"])),
                                  bool(data.get("auth_required", False)))
        except (KeyError, TypeError, ValueError) as err:
            raise ZeusdError(f"{self.endpoint.describe()} answered /discover without zeusd's fields "
                             f"({err!r}); is this zeusd?") from None

    def whoami(self) -> tuple[str, frozenset[str]]:
        """The token's user and scopes (`GET /auth/whoami`; only on daemons that require tokens)."""
        data = self._json(self._request("GET", "/auth/whoami", "check the token"), "/auth/whoami")
        return str(data.get("sub", "?")), frozenset(map(str, data.get("scopes", [])))

    def round_trip_s(self, samples: int = ROUND_TRIP_SAMPLES) -> float:
        """Median round trip of `GET /time`, the cheapest call: what every write pays on top of
        the daemon's own NVML call."""
        trips = []
        for _ in range(samples):
            start = time.perf_counter()
            self._request("GET", "/time", "read /time")
            trips.append(time.perf_counter() - start)
        return statistics.median(trips)

    def write(self, path: str, gpu_id: int, what: str, *, block: bool = True, **params: int) -> float:
        """POST one of zeusd's GPU writes for `gpu_id`; returns its round trip in seconds.

        block=True (what perseus-ext uses): the daemon answers once the NVML call is done and
        reports its per-GPU error, so the change's landing time is known and a failure is seen;
        block=False only says the request was queued."""
        query = {"gpu_ids": str(gpu_id), **{k: str(v) for k, v in params.items()},
                 "block": "true" if block else "false"}
        start = time.perf_counter()
        try:
            self._request("POST", f"/gpu/{path}", what, params=query)
        except ZeusdError as err:
            with self._lock:
                self.stats.failures += 1
                self.stats.last_error = str(err)
            raise
        trip = time.perf_counter() - start
        with self._lock:
            self.stats.writes += 1
            self.stats.round_trips_s.append(trip)
        return trip

    def stats_summary(self) -> dict[str, Any]:
        """`stats.summary()` while no write updates them (the worker may still be writing)."""
        with self._lock:
            return self.stats.summary()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ errors
    def _request(self, method: str, path: str, what: str, params: dict[str, str] | None = None) -> httpx.Response:
        where = self.endpoint.describe()
        try:
            response = self._http.request(method, path, params=params)
        except httpx.TimeoutException:
            raise ZeusdUnreachableError(
                f"{where} did not answer within {self.read_timeout_s:g} s (could not {what}): the "
                "daemon hangs or is overloaded; check it with `systemctl status zeusd`") from None
        except httpx.TransportError as err:
            raise ZeusdUnreachableError(f"{where}: could not {what}: {self._unreachable(err)}") from None
        if response.status_code == 200:
            return response
        raise self._refusal(response, what)

    def _unreachable(self, err: httpx.TransportError) -> str:
        path = self.endpoint.socket_path
        if path is not None and not os.path.exists(path):
            return (f"no socket at {path}: zeusd is not running there; start it (`zeusd serve "
                    f"--socket-path {path}`) or fix {ENV_SOCK_PATH}")
        text = str(err) or type(err).__name__
        if "refused" in text.lower():
            return f"connection refused ({text}): no zeusd is listening; start it or fix {self.endpoint.variable}"
        if "permission" in text.lower():
            return f"{text}: this user may not open the socket; zeusd's --socket-permissions/--socket-gid decide who may"
        return f"{text}: the daemon is down or closed the connection"

    def _refusal(self, response: httpx.Response, what: str) -> ZeusdError:
        where = self.endpoint.describe()
        message = _error_text(response)
        status = response.status_code
        if status == 401:
            why = f"no {ENV_TOKEN} is set" if self.token is None else f"the token in {ENV_TOKEN} was rejected"
            return ZeusdAuthError(f"{where} refused to {what} (HTTP 401: {message}): {why}; {TOKEN_HELP}")
        if status == 403 and "scope" in message:
            return ZeusdAuthError(f"{where} refused to {what} (HTTP 403: {message}): the token lacks scope "
                                  f"'{CONTROL_SCOPE}'; {TOKEN_HELP}")
        if status == 403:
            return ZeusdError(f"{where} could not {what} (HTTP 403: {message}): the daemon itself lacks the "
                              "privilege; zeusd must run as root to change clocks")
        if status == 404 and "not enabled" in message:
            return ZeusdCapabilityError(
                f"{where} was started without the '{CONTROL_SCOPE}' API group (HTTP 404: {message}); the "
                f"operator must restart it with `zeusd serve --enable {CONTROL_SCOPE},gpu-read ...`")
        if status == 404:
            return ZeusdCapabilityError(f"{where} has no {response.request.url.path} (HTTP 404: {message}); "
                                        "it is not zeusd, or a zeusd older than 0.2")
        return ZeusdError(f"{where} could not {what} (HTTP {status}: {message})")

    def _json(self, response: httpx.Response, path: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ZeusdError(f"{self.endpoint.describe()} answered {path} with {response.text[:200]!r}, "
                             "not zeusd's JSON; is this zeusd?")
        return data


def _error_text(response: httpx.Response) -> str:
    """zeusd's error body, `{"error": ...}` or per-GPU `{"errors": {"<id>": ...}}`, as one line."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    if isinstance(data, dict) and isinstance(data.get("errors"), dict):
        return "; ".join(f"GPU {gpu}: {text}" for gpu, text in sorted(data["errors"].items()))
    return response.text.strip()[:300]
