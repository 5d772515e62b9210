"""Every network dependency is bounded by its timeout against a server that accepts the
connection and never answers, and the error names the host and the setting."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from perseus_ext.cli import main
from perseus_ext.errors import PerseusError
from perseus_ext.policies.batch_size import BatchSizeOptimizer, read_states
from perseus_ext.policies.bso_store import StoreError


@pytest.fixture
def silent_server():
    """A TCP server that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for connection in held:
        connection.close()
    server.close()


def test_the_store_cli_against_a_silent_postgresql_port_ends_within_its_timeout(silent_server, capsys):
    """Before: 61 s (the timeout was the SQLite lock wait, 60 s)."""
    began = time.monotonic()
    code = main(["batch-size", f"postgresql://user@127.0.0.1:{silent_server}/bso", "--timeout", "2"])
    took = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == 2 and took < 8, (took, err)
    assert f"127.0.0.1:{silent_server}/bso is unavailable" in err and "no answer within --timeout = 2 s" in err


def test_the_stores_default_timeout_bounds_a_job_to_a_few_seconds(silent_server):
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"no answer within perseus.policy.batch_size.timeout_s = 5 s"):
        BatchSizeOptimizer(f"postgresql://user@127.0.0.1:{silent_server}/bso", "job", [8, 16], 8, max_power_w=300.0)
    assert time.monotonic() - began < 12


def test_a_directory_given_as_the_store_is_named_as_such(tmp_path, capsys):
    assert main(["batch-size", str(tmp_path)]) == 2
    assert f"batch-size store {tmp_path} is a directory, not a store file" in capsys.readouterr().err
    with pytest.raises(StoreError, match="does not exist"):
        read_states(tmp_path / "missing.db")


@pytest.mark.parametrize("quantity_name", ["carbon", "power budget"])
def test_a_silent_signal_endpoint_is_bounded_by_its_timeout_and_named(silent_server, caplog, quantity_name):
    """The carbon source and the power-budget URL: a fetch from a server that accepts and never
    answers ends within its timeout_s, keeps the last value and names the URL and the key."""
    from perseus_ext.policies.carbon import CARBON, HTTPCarbonSignal
    from perseus_ext.policies.power_budget import POWER_BUDGET

    quantity = {"carbon": CARBON, "power budget": POWER_BUDGET}[quantity_name]
    url = f"http://127.0.0.1:{silent_server}/signal"
    signal = HTTPCarbonSignal(url, timeout_s=0.5, start=False, quantity=quantity)
    began = time.monotonic()
    assert signal.fetch() is None
    assert time.monotonic() - began < 1.5 and signal.failures == 1
    assert f"{url} failed (timed out after 0.5 s) (bounded by {quantity.key}.timeout_s = 0.5 s)" in caplog.text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(location=st.one_of(
    st.text(max_size=30),
    st.builds("{}://{}@{}:{}/{}".format, st.sampled_from(["postgresql", "sqlite", "mysql", "", "postgres"]),
              st.text(max_size=4), st.sampled_from(["127.0.0.1", "[::1", "[::1]", "", "\x00"]),
              st.text(alphabet="0123456789:x", max_size=6), st.text(max_size=4)),
    st.integers(4000, 5000).map(lambda n: "sqlite:///" + "a" * n)))
@example(location="\n")  # a path with a newline: the message ran over two lines
@example(location="sqlite:///a\nb")
def test_any_store_location_gives_states_or_a_store_error(tmp_path, location):
    """Found: a NUL byte (ValueError), a malformed port (ValueError), a file name longer than
    the OS allows (OSError) all ended in tracebacks; a newline in the path split the message."""
    try:
        read_states(location, network_timeout_s=2.0)
    except PerseusError as err:
        assert "\n" not in str(err)
