"""Carbon-intensity signals (gCO2/kWh) for the Chase policy: a CSV trace, a user callback, or an
HTTP JSON endpoint.

A signal must never stall or crash training: the HTTP endpoint is polled on a background thread
and a failing fetch or callback keeps the last good value (and logs why).
"""

from __future__ import annotations

import abc
import csv
import json
import logging
import math
import threading
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from perseus_ext.errors import ConfigError

logger = logging.getLogger(__name__)

TIME_COLUMNS = ("timestamp", "time", "datetime")
INTENSITY_COLUMNS = ("carbon_intensity", "intensity", "gco2_per_kwh")


class CarbonSignalError(ConfigError):
    """A carbon-intensity source is unusable as configured (bad file, bad URL, ...)."""


def _check_intensity(value: object, where: str) -> float:
    """A finite, non-negative intensity, or CarbonSignalError saying where it came from."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CarbonSignalError(
            f"{where}: carbon intensity {value!r} is not a number (gCO2/kWh)"
        ) from None
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise CarbonSignalError(
            f"{where}: carbon intensity must be a finite number >= 0 gCO2/kWh, got {value!r}"
        )
    return number


class CarbonSignal(abc.ABC):
    """Grid carbon intensity over time; `now` is a POSIX timestamp (seconds)."""

    #: A known upper bound of the intensity (a trace's maximum), used as Chase's MaxCarbon.
    max_intensity: float | None = None

    @abc.abstractmethod
    def intensity(self, now: float) -> float | None:
        """The intensity at `now`, the last good value if the source failed, None if none yet."""

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
        return float(text)
    except ValueError:
        pass
    try:  # Python < 3.11 does not read a trailing "Z"
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise CarbonSignalError(
            f"{where}: timestamp {text!r} is neither seconds nor ISO 8601 (e.g. 2024-05-01T13:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


class CSVCarbonTrace(CarbonSignal):
    """A piecewise-constant intensity time series from a CSV with a header row.

    Columns: one of `timestamp`/`time`/`datetime` (seconds or ISO 8601) and one of
    `carbon_intensity`/`intensity`/`gco2_per_kwh`. Each row's value holds until the next row;
    after the last row the last value holds. `align="start"` replays the trace from its first
    row when training starts (experiments, emulation); `align="clock"` reads it at wall-clock
    time (a real grid trace or forecast for today). The trace also serves as its own forecast.
    """

    def __init__(self, path: str | Path, align: str = "start"):
        if align not in ("start", "clock"):
            raise CarbonSignalError(
                f"perseus.policy.carbon.align must be 'start' or 'clock', got {align!r}"
            )
        self.path = Path(path)
        self.align = align
        self.times, self.values = self._read(self.path)
        self.max_intensity = float(self.values.max())
        self._offset: float | None = 0.0 if align == "clock" else None
        self._warned_past_end = False

    @staticmethod
    def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                header = [name.strip().lower() for name in reader.fieldnames or []]
                rows = list(reader)
        except OSError as err:
            raise CarbonSignalError(
                f"cannot read carbon trace {path}: {err.strerror or err}"
            ) from None
        time_col = next((c for c in TIME_COLUMNS if c in header), None)
        value_col = next((c for c in INTENSITY_COLUMNS if c in header), None)
        if time_col is None or value_col is None:
            raise CarbonSignalError(
                f"{path}: header {header} needs a time column ({'/'.join(TIME_COLUMNS)}) and an "
                f"intensity column ({'/'.join(INTENSITY_COLUMNS)}), e.g. 'timestamp,carbon_intensity'"
            )
        if not rows:
            raise CarbonSignalError(
                f"{path}: carbon trace is empty; add at least one '{time_col},{value_col}' row"
            )
        times, values = [], []
        for number, row in enumerate(rows, start=2):
            norm = {str(k).strip().lower(): v for k, v in row.items()}
            where = f"{path}, line {number}"
            times.append(_parse_time(norm.get(time_col) or "", where))
            values.append(_check_intensity((norm.get(value_col) or "").strip(), where))
            if len(times) > 1 and times[-1] <= times[-2]:
                raise CarbonSignalError(
                    f"{where}: timestamps must increase strictly; sort the trace by time"
                )
        return np.array(times), np.array(values)

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
                "carbon trace %s ended; holding its last value %.1f gCO2/kWh",
                self.path,
                self.values[-1],
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
    ):
        if not callable(fn):
            raise CarbonSignalError(f"perseus.policy.carbon.callback must be callable, got {fn!r}")
        self.fn = fn
        self.forecast_fn = forecast_fn
        self.max_intensity = max_intensity
        self._last: float | None = None

    def _call(self, what: str, fn: Callable[..., float], *args: float) -> float | None:
        try:
            self._last = _check_intensity(
                fn(*args), f"carbon {what} {getattr(fn, '__name__', fn)!r}"
            )
        except Exception as err:  # a user callback must never take training down
            logger.warning(
                "carbon %s failed (%s); keeping last value %s gCO2/kWh", what, err, self._last
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


class HTTPCarbonSignal(CarbonSignal):
    """Polls a JSON endpoint on a daemon thread every `refresh_s`; `intensity()` never blocks.

    The response is a bare number or an object holding the value at the dotted path `field`
    (default ``carbonIntensity``, the Electricity Maps name). Timeouts, HTTP errors and bad
    payloads are logged and keep the last good value; before the first success it is None.
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
    ):
        scheme = urllib.parse.urlparse(url).scheme
        if scheme not in ("http", "https"):
            raise CarbonSignalError(
                f"perseus.policy.carbon.url must be an http(s) URL, got {url!r}"
            )
        self.url = url
        self.field = field
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.headers = dict(headers or {})
        self.max_intensity = max_intensity
        self.failures = 0
        self._last: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._poll, name="perseus-carbon-http", daemon=True
            )
            self._thread.start()

    def fetch(self) -> float | None:
        """One synchronous fetch (what the poller runs); returns the value now held."""
        request = urllib.request.Request(
            self.url, headers={"Accept": "application/json", **self.headers}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                document = json.loads(response.read().decode("utf-8"))
            value = _check_intensity(extract_field(document, self.field), self.url)
        except Exception as err:  # timeouts, refused connections, bad JSON: never fatal
            with self._lock:
                self.failures += 1
                last = self._last
            logger.warning(
                "carbon endpoint %s failed (%s); keeping last value %s gCO2/kWh",
                self.url,
                err,
                last,
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
