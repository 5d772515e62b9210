"""Chase: carbon-intensity signals (CSV, callback, HTTP) and the carbon-aware frontier policy.

Hand-computable: with cost eta*c*E + (1-eta)*P*Cmax*T the policy takes a step saving dE joules
per extra second iff dE > k = (1 - eta) * P * Cmax / (eta * c).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from perseus_ext.policies import (
    CallbackCarbonSignal,
    CarbonCost,
    CarbonSignalError,
    ChasePolicy,
    CSVCarbonTrace,
    HTTPCarbonSignal,
    ZeusPolicy,
    build_policy,
)
from perseus_ext.policies.carbon import extract_field
from test_policies import POINTS, A, B, C, D, index, make_frontier


class FakeClock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_trace(
    path: Path, rows: list[tuple[object, object]], header: str = "timestamp,carbon_intensity"
) -> Path:
    path.write_text(header + "\n" + "".join(f"{t},{v}\n" for t, v in rows))
    return path


# ------------------------------------------------------------------------- CSV traces


def test_csv_trace_steps_align_and_forecast(tmp_path: Path) -> None:
    trace = CSVCarbonTrace(write_trace(tmp_path / "t.csv", [(0, 400), (3600, 50), (7200, 300)]))
    assert trace.max_intensity == 400.0
    start = 5_000.0  # align="start": the first row plays when training starts
    assert trace.intensity(start) == 400.0
    assert trace.intensity(start + 3599) == 400.0
    assert trace.intensity(start + 3600) == 50.0
    assert trace.intensity(start + 10**6) == 300.0  # after the end the last value holds
    # Mean over [3000, 4200] in trace time: 600 s at 400, 600 s at 50.
    assert trace.mean_intensity(start + 3000, start + 4200) == pytest.approx(225.0)


def test_csv_trace_iso_timestamps_on_the_wall_clock(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "iso.csv",
        [("2024-05-01T00:00:00Z", 120), ("2024-05-01T01:00:00+00:00", 80)],
        header="datetime,intensity",
    )
    trace = CSVCarbonTrace(path, align="clock")
    one_am = 1714525200.0  # 2024-05-01T01:00:00Z
    assert trace.intensity(one_am - 1) == 120.0 and trace.intensity(one_am) == 80.0


@pytest.mark.parametrize(
    "content, message",
    [
        ("timestamp,carbon_intensity\n", "carbon trace is empty"),
        ("", "needs a time column"),
        ("when,value\n0,1\n", "needs a time column"),
        ("timestamp,carbon_intensity\n0,abc\n", "bad.csv:2: carbon intensity 'abc' is not a number"),
        ("timestamp,carbon_intensity\n0,-5\n", "must be a finite number >= 0"),
        ("timestamp,carbon_intensity\n10,5\n5,6\n", "bad.csv:3: timestamps must increase"),
        ("timestamp,carbon_intensity\nyesterday,5\n", "neither seconds nor ISO 8601"),
        # each of these ended in a traceback or was accepted silently before the bounded reader
        ("timestamp,carbon_intensity\n0,5\n1\n", "bad.csv:3: carbon_intensity: the row has 1 cells, the header 2"),
        ("timestamp,carbon_intensity\nnan,5\n", "bad.csv:2: timestamp 'nan' is not a time"),
        ("timestamp,carbon_intensity\n1e300,5\n", "bad.csv:2: timestamp '1e300' is not a time"),
        ("timestamp,carbon_intensity\n0,1e300\n", "bad.csv:2: carbon_intensity: carbon intensity 1e+300 gCO2/kWh is above"),
        ("timestamp,carbon_intensity\n0,5\n1,caf\xe9\n", "bad.csv:3: the carbon trace is not UTF-8 text"),
        ("timestamp,carbon_intensity\n0,5\r1,6\n", "bad.csv:2: not a CSV row (new-line character seen"),  # was _csv.Error
        ("timestamp,carbon_intensity\n0,5\x00\n", "bad.csv:2: carbon intensity '5\\x00' is not a number"),
        ("timestamp,carbon_intensity\n" + "1" * 70_000 + ",5\n", "bad.csv:2: the line is longer than 65536 bytes"),
    ],
)
def test_bad_traces_get_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(CarbonSignalError, match=re.escape(message)):
        CSVCarbonTrace(path)


def test_missing_trace_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(CarbonSignalError, match="cannot read carbon trace"):
        build_policy(
            {"type": "chase", "max_power_w": 400, "carbon": {"csv": str(tmp_path / "none.csv")}}
        )


# ------------------------------------------------------------------------- the Chase policy


@pytest.mark.parametrize(
    "intensity, expected",
    [
        (400.0, C),  # at MaxCarbon Chase is Zeus: k = 0.2*60/0.8 = 15 -> C
        (100.0, B),  # k = 60
        (20.0, A),  # k = 300: a clean grid favours speed
    ],
)
def test_chase_hand_computed(intensity: float, expected: int) -> None:
    frontier = make_frontier(POINTS)
    cost = CarbonCost(0.8, 60.0, CallbackCarbonSignal(lambda now: intensity), max_carbon=400.0)
    assert index(frontier, ChasePolicy(cost).select(frontier, None)) == expected
    if intensity == 400.0:
        assert ChasePolicy(cost).select(frontier, None) == ZeusPolicy(0.8, 60.0).select(
            frontier, None
        )


def test_carbon_trace_moves_the_operating_point_both_ways(tmp_path: Path) -> None:
    frontier = make_frontier(POINTS)
    clock = FakeClock()
    trace = CSVCarbonTrace(write_trace(tmp_path / "day.csv", [(0, 400), (3600, 20), (7200, 400)]))
    policy = build_policy(
        {
            "type": "chase",
            "eta": 0.8,
            "max_power_w": 60,
            "period_s": 600,
            "carbon": {"csv": str(trace.path)},
        },
        clock=clock,
    )
    start = clock.now
    chosen = []
    for minute in range(0, 181, 10):
        clock.now = start + 60 * minute
        chosen.append(index(frontier, policy.select(frontier, None)))
    # High (efficient plan C), low from minute 60 (fast plan A), high again from minute 120.
    assert chosen[:6] == [C] * 6
    assert chosen[6:12] == [A] * 6
    assert chosen[12:] == [C] * 7
    # MaxCarbon came from the trace (400) since none was configured.
    assert policy.cost.max_carbon == 400.0


def test_period_limits_how_often_the_signal_is_read() -> None:
    calls: list[float] = []

    def signal(now: float) -> float:
        calls.append(now)
        return 100.0

    clock = FakeClock(0.0)
    cost = CarbonCost(
        0.5, 400.0, CallbackCarbonSignal(signal), max_carbon=400.0, period_s=300.0, clock=clock
    )
    for second in range(0, 901, 30):
        clock.now = float(second)
        cost.weights()
    assert calls == [0.0, 300.0, 600.0, 900.0]


def test_forecast_horizon_uses_the_mean_ahead(tmp_path: Path) -> None:
    trace = CSVCarbonTrace(write_trace(tmp_path / "f.csv", [(0, 400), (600, 0)]))
    clock = FakeClock(0.0)
    cost = CarbonCost(0.5, 100.0, trace, period_s=60.0, forecast_horizon_s=1200.0, clock=clock)
    cost.weights()
    assert cost.intensity == pytest.approx(200.0)  # half the next 20 minutes at 400, half at 0


def test_straggler_still_caps_chase() -> None:
    frontier = make_frontier(POINTS)
    policy = ChasePolicy(
        CarbonCost(0.8, 60.0, CallbackCarbonSignal(lambda now: 20.0), max_carbon=400.0)
    )
    assert index(frontier, policy.select(frontier, None)) == A
    # The straggler needs 12.5 s: A, B, C all make it and C is the cheapest of them.
    assert index(frontier, policy.select(frontier, 12.5)) == C
    assert index(frontier, policy.select(frontier, 20.0)) == D


def test_carbon_report_counts_emitted_and_saved() -> None:
    frontier = make_frontier(POINTS)  # baseline energy 1100 J
    clock = FakeClock()
    values = {"now": 360.0}
    policy = ChasePolicy(
        CarbonCost(
            0.8,
            60.0,
            CallbackCarbonSignal(lambda now: values["now"]),
            max_carbon=400.0,
            period_s=1.0,
            clock=clock,
        )
    )
    plan = policy.select(frontier, None)
    policy.record_iteration(plan.energy)  # 850 J at 360 g/kWh
    clock.now += 10
    values["now"] = 36.0
    plan = policy.select(frontier, None)
    policy.record_iteration(plan.energy)  # 1000 J at 36 g/kWh
    report = policy.report
    assert report.iterations == 2
    assert report.kg_emitted == pytest.approx((850 * 360 + 1000 * 36) / 3.6e6 / 1000)
    assert report.kg_saved == pytest.approx((250 * 360 + 100 * 36) / 3.6e6 / 1000)
    assert "kgCO2 emitted" in report.summary()


def test_failing_callback_keeps_last_value(caplog: pytest.LogCaptureFixture) -> None:
    answers = iter([250.0, RuntimeError("grid API down"), float("nan")])

    def flaky(now: float) -> float:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    signal = CallbackCarbonSignal(flaky)
    with caplog.at_level(logging.WARNING):
        assert signal.intensity(0.0) == 250.0
        assert signal.intensity(1.0) == 250.0
        assert signal.intensity(2.0) == 250.0
    assert "grid API down" in caplog.text and "keeping last value 250.0" in caplog.text


# ------------------------------------------------------------------------- HTTP endpoint


class IntensityServer:
    """A JSON endpoint on 127.0.0.1 that serves `self.payload` (optionally slowly); it shuts
    itself down after `lifetime_s` so a failing test can never leave it running."""

    def __init__(self, payload: object, lifetime_s: float = 30.0):
        self.payload = payload
        self.delay_s = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(outer.delay_s)
                body = json.dumps(outer.payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/intensity"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.timer = threading.Timer(lifetime_s, self.stop)
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[IntensityServer]:
    srv = IntensityServer({"zone": "test", "carbonIntensity": 321})
    yield srv
    srv.stop()


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_http_signal_polls_and_keeps_last_value_when_the_endpoint_dies(
    server: IntensityServer,
) -> None:
    signal = HTTPCarbonSignal(server.url, refresh_s=0.05, timeout_s=0.5)
    try:
        wait_for(lambda: signal.intensity(0.0) == 321.0)
        server.payload = {"carbonIntensity": 123.5}
        wait_for(lambda: signal.intensity(0.0) == 123.5)
        server.stop()
        failures = signal.failures
        wait_for(lambda: signal.failures > failures)
        assert signal.intensity(0.0) == 123.5
    finally:
        signal.close()


def test_http_timeout_never_blocks_the_reader(server: IntensityServer) -> None:
    server.delay_s = 2.0
    signal = HTTPCarbonSignal(server.url, refresh_s=0.05, timeout_s=0.2)
    try:
        started = time.monotonic()
        assert signal.intensity(0.0) is None  # nothing yet, and no waiting for it
        assert time.monotonic() - started < 0.05
        wait_for(lambda: signal.failures >= 1)
    finally:
        signal.close()


def test_http_nested_field_and_bare_number() -> None:
    uk = {"data": [{"intensity": {"forecast": 180, "actual": 175}}]}
    assert extract_field(uk, "data.0.intensity.actual") == 175
    assert extract_field(42.0, "ignored") == 42.0
    with pytest.raises(ValueError, match="no field 'carbonIntensity'"):
        extract_field({"other": 1}, "carbonIntensity")


def test_unreachable_endpoint_falls_back_to_perseus(caplog: pytest.LogCaptureFixture) -> None:
    frontier = make_frontier(POINTS)
    url = f"http://127.0.0.1:{closed_port()}/intensity"
    with caplog.at_level(logging.WARNING):
        policy = build_policy(
            {
                "type": "chase",
                "eta": 1.0,
                "max_power_w": 60,
                "carbon": {"url": url, "timeout_s": 0.5, "max_carbon": 400},
            }
        )
        try:
            wait_for(lambda: policy.cost.signal.failures >= 1)
            # No reading ever arrived: never slow down on missing information.
            assert policy.select(frontier, None) == frontier.fastest
            assert policy.select(frontier, 12.5) == frontier.plan_for_deadline(12.5)
        finally:
            policy.close()
    assert f"carbon endpoint {url} failed" in caplog.text


def test_chase_over_http_end_to_end(server: IntensityServer) -> None:
    frontier = make_frontier(POINTS)
    clock = FakeClock()
    policy = build_policy(
        {
            "type": "chase",
            "eta": 0.8,
            "max_power_w": 60,
            "period_s": 0.05,
            "carbon": {"url": server.url, "max_carbon": 400, "timeout_s": 1},
        },
        clock=clock,
    )
    try:
        server.payload = {"carbonIntensity": 400}
        wait_for(lambda: policy.cost.signal.intensity(0) == 400)
        clock.now += 1
        assert index(frontier, policy.select(frontier, None)) == C
        server.payload = {"carbonIntensity": 20}
        wait_for(lambda: policy.cost.signal.intensity(0) == 20)
        clock.now += 1
        assert index(frontier, policy.select(frontier, None)) == A
    finally:
        policy.close()


# ------------------------------------------------------------- a good network citizen


class RoutingServer:
    """Endpoints for the fetch's network behaviour; records the headers of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                port = outer.server.server_address[1]
                if self.path == "/to-other-host":
                    self._redirect(f"http://localhost:{port}/value")
                elif self.path == "/to-same-origin":
                    self._redirect("/value")
                elif self.path == "/loop":
                    self._redirect("/loop")
                elif self.path == "/huge":
                    self.send_response(200)
                    self.end_headers()  # no Content-Length: read until the server closes
                    self._write(b"[" + b"0," * (1 << 20) + b"0]")
                elif self.path == "/drip":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(100):
                        if not self._write(b" "):
                            return
                        time.sleep(0.05)
                else:
                    self.send_response(200)
                    self.end_headers()
                    self._write(b'{"carbonIntensity": 100}')

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.end_headers()

            def _write(self, data: bytes) -> bool:
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                    return True
                except (BrokenPipeError, ConnectionResetError):
                    return False

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def routes() -> Iterator[RoutingServer]:
    srv = RoutingServer()
    yield srv
    srv.stop()


def one_fetch(url: str, **kwargs) -> HTTPCarbonSignal:
    signal = HTTPCarbonSignal(url, start=False, headers={"auth-token": "secret"}, **kwargs)
    signal.fetch()
    return signal


def test_tokens_never_follow_a_redirect_to_another_host(routes: RoutingServer) -> None:
    assert one_fetch(f"{routes.base}/to-other-host").intensity(0) == 100.0
    (first, first_headers), (second, second_headers) = routes.requests
    assert first == "/to-other-host" and first_headers["auth-token"] == "secret"
    assert second == "/value" and "auth-token" not in second_headers
    assert second_headers["host"].startswith("localhost:")
    routes.requests.clear()
    assert one_fetch(f"{routes.base}/to-same-origin").intensity(0) == 100.0
    assert [h.get("auth-token") for _, h in routes.requests] == ["secret", "secret"]
    looping = one_fetch(f"{routes.base}/loop")
    assert looping.intensity(0) is None and looping.failures == 1


def test_response_size_is_capped(routes: RoutingServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        signal = one_fetch(f"{routes.base}/huge", max_response_bytes=4096)
    assert signal.failures == 1 and signal.intensity(0) is None
    assert "exceeds the 4096-byte cap" in caplog.text


def test_the_timeout_bounds_the_whole_fetch(routes: RoutingServer, caplog: pytest.LogCaptureFixture) -> None:
    """The server sends a byte every 50 ms for 5 s: no single read times out, the fetch does."""
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        signal = one_fetch(f"{routes.base}/drip", timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert signal.failures == 1 and 0.5 <= elapsed < 1.5
    assert "timed out after 0.5 s" in caplog.text


def test_one_poller_per_job_other_ranks_are_fed() -> None:
    """Rank 0 polls and broadcasts; the others feed the broadcast value to an ExternalSignal,
    and their policy then decides exactly as rank 0's does."""
    from perseus_ext.policies.carbon import ExternalSignal

    frontier = make_frontier(POINTS)
    clock = FakeClock()
    fed = ExternalSignal()
    policy = ChasePolicy(CarbonCost(0.8, 60, fed, max_carbon=400, period_s=1.0, clock=clock))
    assert policy.select(frontier, None) == frontier.fastest  # nothing fed yet: full speed
    for value, expected in ((400.0, C), (20.0, A)):
        fed.feed(value)
        clock.now += 1.0
        assert index(frontier, policy.select(frontier, None)) == expected
    fed.feed(None)  # the poller has nothing new: keep the last value
    assert fed.intensity(0.0) == 20.0
    with pytest.raises(CarbonSignalError, match="must be a finite number >= 0"):
        fed.feed(-1.0)
