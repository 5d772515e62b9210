"""Time-varying signals for the policies: Chase's carbon intensity (gCO2/kWh) and the power
budget (watts) of `power_budget.py`. Sources: a CSV trace, a user callback, an HTTP JSON
endpoint, or a value fed from outside (`ExternalSignal`).

A signal must never stall or crash training: the HTTP endpoint is polled on a background thread
and a failing fetch or callback keeps the last good value (and logs why). The endpoint is
fetched as a good network citizen: the timeout bounds the whole fetch (connect, redirects and
every read), the body is capped, and configured headers (tokens) never follow a redirect to
another origin.

One poller per job: the rank that polls (say global rank 0) broadcasts each value; every other
rank holds an `ExternalSignal` and `feed()`s it the broadcast value, so the policy code is the
same on every rank and only one process talks to the endpoint.
"""

from __future__ import annotations

import abc
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from array import array
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from perseus_ext.background import start_background
from perseus_ext.config.policy import DEFAULT_MAX_RESPONSE_BYTES
from perseus_ext.errors import ConfigError, PerseusError

logger = logging.getLogger(__name__)

TIME_COLUMNS = ("timestamp", "time", "datetime")
INTENSITY_COLUMNS = ("carbon_intensity", "intensity", "gco2_per_kwh")
MAX_REDIRECTS = 5
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_READ_CHUNK_BYTES = 65536


@dataclass(frozen=True)
class SignalQuantity:
    """What a signal measures: names for messages, its unit, its config key, its CSV columns."""

    label: str  # short, in log lines: "carbon"
    value_name: str  # in errors: "carbon intensity"
    unit: str
    key: str  # config section, in errors
    columns: tuple[str, ...]  # accepted CSV value columns, first match wins


CARBON = SignalQuantity(
    "carbon", "carbon intensity", "gCO2/kWh", "perseus.policy.carbon", INTENSITY_COLUMNS
)


MAX_READING = 1e12  # no carbon intensity (gCO2/kWh) or power budget (W) is larger
MAX_TIMESTAMP_S = 1e11  # POSIX seconds: about the year 5138


class CarbonSignalError(ConfigError):
    """A signal source is unusable as configured (bad file, bad URL, ...)."""


def check_value(value: object, where: str, quantity: SignalQuantity = CARBON) -> float:
    """A finite, non-negative reading, or CarbonSignalError saying where it came from."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CarbonSignalError(
            f"{where}: {quantity.value_name} {value!r} is not a number ({quantity.unit})"
        ) from None
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise CarbonSignalError(
            f"{where}: {quantity.value_name} must be a finite number >= 0 {quantity.unit}, "
            f"got {value!r}"
        )
    return number


class CarbonSignal(abc.ABC):
    """A quantity over time (carbon intensity unless `quantity` says otherwise); `now` is a
    POSIX timestamp (seconds)."""

    quantity: SignalQuantity = CARBON
    #: A known upper bound of the value (a trace's maximum), used as Chase's MaxCarbon.
    max_intensity: float | None = None

    @abc.abstractmethod
    def intensity(self, now: float) -> float | None:
        """The value at `now`, the last good value if the source failed, None if none yet."""

    def mean_intensity(self, start: float, end: float) -> float | None:
        """Forecast of the mean intensity over [start, end]. Sources that cannot look ahead use
        persistence (the current value), the usual baseline for short horizons."""
        return self.intensity(start)

    def close(self) -> None:
        """Stop background work; idempotent."""


def _parse_time(text: str, where: str) -> float:
    """POSIX seconds from a number or an ISO 8601 date (naive dates are taken as UTC)."""
    text = text.strip()
    try:
        seconds: float | None = float(text)
    except ValueError:
        seconds = None
    if seconds is not None:
        return _finite_time(seconds, text, where)
    try:  # Python < 3.11 does not read a trailing "Z"
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise CarbonSignalError(
            f"{where}: timestamp {text!r} is neither seconds nor ISO 8601 (e.g. 2024-05-01T13:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _finite_time(seconds: float, text: str, where: str) -> float:
    if not math.isfinite(seconds) or abs(seconds) > MAX_TIMESTAMP_S:
        raise CarbonSignalError(f"{where}: timestamp {text.strip()!r} is not a time (seconds within "
                                f"+/-{MAX_TIMESTAMP_S:g}, or ISO 8601)")
    return seconds


class CSVCarbonTrace(CarbonSignal):
    """A piecewise-constant intensity time series from a CSV with a header row.

    Columns: one of `timestamp`/`time`/`datetime` (seconds or ISO 8601) and one of
    `carbon_intensity`/`intensity`/`gco2_per_kwh`. Each row's value holds until the next row;
    after the last row the last value holds. `align="start"` replays the trace from its first
    row when training starts (experiments, emulation); `align="clock"` reads it at wall-clock
    time (a real grid trace or forecast for today). The trace also serves as its own forecast.
    """

    def __init__(self, path: str | Path, align: str = "start", quantity: SignalQuantity = CARBON):
        if align not in ("start", "clock"):
            raise CarbonSignalError(f"{quantity.key}.align must be 'start' or 'clock', got {align!r}")
        self.path = Path(path)
        self.align = align
        self.quantity = quantity
        self.times, self.values = self._read(self.path, quantity)
        self.max_intensity = float(self.values.max())
        self._offset: float | None = 0.0 if align == "clock" else None
        self._warned_past_end = False

    @staticmethod
    def _read(path: Path, quantity: SignalQuantity) -> tuple[np.ndarray, np.ndarray]:
        """The trace, read one line at a time through the bounded reader (size, line length
        and UTF-8 checked; times and values finite, values within MAX_READING): any problem is
        one CarbonSignalError naming the file, the line and the column."""
        from perseus_ext.inputs import TABLE_LIMIT_BYTES, InputError, check_file, csv_cells, iter_lines

        what = f"{quantity.label} trace"
        fix = f"give a CSV with a header 'timestamp,{quantity.columns[0]}' and one reading per line ({quantity.key})"
        header: list[str] | None = None
        times, values = array("d"), array("d")
        try:
            check_file(path, what=what, limit_bytes=TABLE_LIMIT_BYTES, fix=fix)
            for number, _, text in iter_lines(path, what=what, fix=fix):
                if not text.strip():
                    continue
                row = csv_cells(text, path=path, line=number, fix=fix)
                if header is None:
                    header = [name.strip().lower() for name in row]
                    time_col = next((header.index(c) for c in TIME_COLUMNS if c in header), None)
                    value_col = next((header.index(c) for c in quantity.columns if c in header), None)
                    if time_col is None or value_col is None:
                        raise CarbonSignalError(
                            f"{path}: header {header} needs a time column ({'/'.join(TIME_COLUMNS)}) and a "
                            f"{quantity.value_name} column ({'/'.join(quantity.columns)}), e.g. "
                            f"'timestamp,{quantity.columns[0]}'")
                    continue
                where = f"{path}:{number}"
                if len(row) <= max(time_col, value_col):
                    raise InputError(path, f"the row has {len(row)} cells, the header {len(header)}", fix,
                                     line=number, field=header[max(time_col, value_col)])
                times.append(_parse_time(row[time_col], where))
                value = check_value(row[value_col].strip(), where, quantity)
                if value > MAX_READING:
                    raise InputError(path, f"{quantity.value_name} {value:g} {quantity.unit} is above {MAX_READING:g}",
                                     fix, line=number, field=header[value_col])
                values.append(value)
                if len(times) > 1 and times[-1] <= times[-2]:
                    raise CarbonSignalError(f"{where}: timestamps must increase strictly; sort the trace by time")
        except InputError as err:
            raise CarbonSignalError(str(err).replace(f"cannot read the {what}", f"cannot read {what}")) from None
        if header is None:
            raise CarbonSignalError(
                f"{path}: header [] needs a time column ({'/'.join(TIME_COLUMNS)}) and a {quantity.value_name} "
                f"column ({'/'.join(quantity.columns)}), e.g. 'timestamp,{quantity.columns[0]}'")
        if not times:
            raise CarbonSignalError(f"{path}: {quantity.label} trace is empty; add at least one "
                                    f"'{header[time_col]},{header[value_col]}' row")
        return np.frombuffer(times, dtype=np.float64).copy(), np.frombuffer(values, dtype=np.float64).copy()

    def _trace_time(self, now: float) -> float:
        if self._offset is None:
            self._offset = float(self.times[0]) - now
        return now + self._offset

    def _value_at(self, trace_times: np.ndarray) -> np.ndarray:
        index = np.searchsorted(self.times, trace_times, side="right") - 1
        return self.values[np.clip(index, 0, len(self.values) - 1)]

    def intensity(self, now: float) -> float:
        at = self._trace_time(now)
        if at > self.times[-1] and not self._warned_past_end and len(self.times) > 1:
            self._warned_past_end = True
            logger.warning(
                "%s trace %s ended; holding its last value %.1f %s",
                self.quantity.label,
                self.path,
                self.values[-1],
                self.quantity.unit,
            )
        return float(self._value_at(np.array([at]))[0])

    def mean_intensity(self, start: float, end: float) -> float:
        """Exact time-weighted mean of the step function over [start, end]."""
        a, b = self._trace_time(start), self._trace_time(end)
        if b <= a:
            return self.intensity(start)
        inside = self.times[(self.times > a) & (self.times < b)]
        edges = np.concatenate(([a], inside, [b]))
        return float(np.dot(self._value_at(edges[:-1]), np.diff(edges)) / (b - a))


class CallbackCarbonSignal(CarbonSignal):
    """Intensity from a user function `fn(now) -> gCO2/kWh`; an optional `forecast_fn(start, end)`
    returns the forecast mean over a window. Exceptions and bad values keep the last good value."""

    def __init__(
        self,
        fn: Callable[[float], float],
        forecast_fn: Callable[[float, float], float] | None = None,
        max_intensity: float | None = None,
        quantity: SignalQuantity = CARBON,
    ):
        if not callable(fn):
            raise CarbonSignalError(f"{quantity.key}.callback must be callable, got {fn!r}")
        self.quantity = quantity
        self.fn = fn
        self.forecast_fn = forecast_fn
        self.max_intensity = max_intensity
        self._last: float | None = None

    def _call(self, what: str, fn: Callable[..., float], *args: float) -> float | None:
        try:
            self._last = check_value(
                fn(*args), f"{self.quantity.label} {what} {getattr(fn, '__name__', fn)!r}", self.quantity
            )
        except Exception as err:  # a user callback must never take training down
            logger.warning(
                "%s %s failed (%s); keeping last value %s %s",
                self.quantity.label, what, err, self._last, self.quantity.unit,
            )
        return self._last

    def intensity(self, now: float) -> float | None:
        return self._call("callback", self.fn, now)

    def mean_intensity(self, start: float, end: float) -> float | None:
        if self.forecast_fn is None:
            return self.intensity(start)
        return self._call("forecast callback", self.forecast_fn, start, end)


def extract_field(document: object, field: str | None) -> object:
    """`document` itself if it is a number, else the value at a dotted path such as
    ``data.0.intensity.actual`` (integers index lists)."""
    if isinstance(document, (int, float)) and not isinstance(document, bool):
        return document
    if not field:
        raise ValueError("response is not a bare number and no 'field' is configured")
    value = document
    for part in field.split("."):
        if isinstance(value, list) and part.lstrip("-").isdigit():
            value = value[int(part)]
        elif isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            raise ValueError(f"response has no field {field!r} (missing {part!r})")
    return value


class FetchError(PerseusError):
    """One fetch of an endpoint failed (the poller logs it and keeps the last value)."""


def _origin(url: urllib.parse.SplitResult) -> tuple[str, str, int]:
    default_port = 443 if url.scheme == "https" else 80
    return url.scheme, (url.hostname or "").lower(), url.port or default_port


def fetch_json(
    url: str,
    *,
    timeout_s: float,
    headers: Mapping[str, str],
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> object:
    """GET `url` and parse its JSON body, within `timeout_s` for everything.

    Follows up to MAX_REDIRECTS redirects; `headers` go only to the configured origin (scheme,
    host, port), never to another one a redirect points at. A body over `max_bytes` is refused.
    The deadline is enforced by shutting the socket down when it passes, so a server that
    drips bytes slowly cannot stretch the fetch beyond it.
    """
    deadline = time.monotonic() + timeout_s
    origin = _origin(urllib.parse.urlsplit(url))
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise FetchError(f"redirected to a non-http(s) URL {url!r}")
        sent = {"Accept": "application/json", "Connection": "close"}
        if _origin(parts) == origin:
            sent.update(headers)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchError(f"timed out after {timeout_s:g} s")
        connection_class = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_class(parts.hostname or "", parts.port, timeout=remaining)
        watchdog: threading.Timer | None = None
        try:
            connection.connect()  # bounded by its own timeout, the time left
            # http.client drops connection.sock once a response will close the connection, so
            # the watchdog holds the socket itself.
            watchdog = threading.Timer(
                max(0.0, deadline - time.monotonic()), _shut_down, args=(connection.sock,)
            )
            watchdog.daemon = True
            start_background(watchdog)
            target = parts.path or "/"
            connection.request("GET", f"{target}?{parts.query}" if parts.query else target, headers=sent)
            response = connection.getresponse()
            if response.status in _REDIRECT_STATUSES and response.getheader("Location"):
                url = urllib.parse.urljoin(url, response.getheader("Location", ""))
                continue
            if response.status != 200:
                raise FetchError(f"HTTP {response.status} {response.reason}")
            body = _read_capped(response, max_bytes)
            if time.monotonic() >= deadline:  # the watchdog cut the body short
                raise FetchError(f"timed out after {timeout_s:g} s")
            return json.loads(body.decode("utf-8"))
        except OSError as err:
            if time.monotonic() >= deadline:
                raise FetchError(f"timed out after {timeout_s:g} s") from None
            raise FetchError(str(err) or type(err).__name__) from None
        finally:
            if watchdog is not None:
                watchdog.cancel()
            connection.close()
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def _shut_down(sock: socket.socket) -> None:
    """Unblock a read in progress: the fetch's deadline has passed."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed: nothing is blocked on it
        pass


def _read_capped(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise FetchError(f"response of {declared} bytes exceeds the {max_bytes}-byte cap")
    body = bytearray()
    while chunk := response.read1(_READ_CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise FetchError(f"response exceeds the {max_bytes}-byte cap")
    return bytes(body)


class HTTPCarbonSignal(CarbonSignal):
    """Polls a JSON endpoint on a daemon thread every `refresh_s`; `intensity()` never blocks.

    The response is a bare number or an object holding the value at the dotted path `field`
    (default ``carbonIntensity``, the Electricity Maps name). Timeouts, HTTP errors and bad
    payloads are logged and keep the last good value; before the first success it is None.
    `timeout_s` bounds each whole fetch; see `fetch_json` for redirects and the size cap.
    """

    def __init__(
        self,
        url: str,
        field: str | None = "carbonIntensity",
        timeout_s: float = 2.0,
        refresh_s: float = 300.0,
        headers: Mapping[str, str] | None = None,
        max_intensity: float | None = None,
        start: bool = True,
        quantity: SignalQuantity = CARBON,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ):
        scheme = urllib.parse.urlparse(url).scheme
        if scheme not in ("http", "https"):
            raise CarbonSignalError(f"{quantity.key}.url must be an http(s) URL, got {url!r}")
        self.url = url
        self.field = field
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.headers = dict(headers or {})
        self.max_intensity = max_intensity
        self.quantity = quantity
        self.max_response_bytes = max_response_bytes
        self.failures = 0
        self._last: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = start_background(threading.Thread(
                target=self._poll, name=f"perseus-{quantity.label}-http", daemon=True
            ))

    def fetch(self) -> float | None:
        """One synchronous fetch (what the poller runs); returns the value now held."""
        try:
            document = fetch_json(
                self.url,
                timeout_s=self.timeout_s,
                headers=self.headers,
                max_bytes=self.max_response_bytes,
            )
            value = check_value(extract_field(document, self.field), self.url, self.quantity)
        except Exception as err:  # timeouts, refused connections, bad JSON: never fatal
            with self._lock:
                self.failures += 1
                last = self._last
            bound = (f" (bounded by {self.quantity.key}.timeout_s = {self.timeout_s:g} s)"
                     if isinstance(err, FetchError) and "timed out" in str(err) else "")
            logger.warning(
                "%s endpoint %s failed (%s)%s; keeping last value %s %s",
                self.quantity.label, self.url, err, bound, last, self.quantity.unit,
            )
            return last
        with self._lock:
            self._last = value
        return value

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.fetch()
            self._stop.wait(self.refresh_s)

    def intensity(self, now: float) -> float | None:
        with self._lock:
            return self._last

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + 1.0)


class ExternalSignal(CarbonSignal):
    """A value fed from outside: the ranks that do not poll hold one and `feed()` it what the
    polling rank broadcast. Before the first value it reads None (policies then fall back to
    full speed, as for any source without a reading)."""

    def __init__(self, quantity: SignalQuantity = CARBON, max_intensity: float | None = None):
        self.quantity = quantity
        self.max_intensity = max_intensity
        self._last: float | None = None
        self._lock = threading.Lock()

    def feed(self, value: float | None) -> None:
        """The latest value (None: the poller has none yet, keep ours)."""
        if value is None:
            return
        checked = check_value(value, f"{self.quantity.label} value fed", self.quantity)
        with self._lock:
            self._last = checked

    def intensity(self, now: float) -> float | None:
        with self._lock:
            return self._last
