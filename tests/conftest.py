"""Settings shared by every test: markers, and a default per-test timeout so a hang fails CI."""

from __future__ import annotations

import os

import pytest

DEFAULT_TEST_TIMEOUT_S = 300


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its settings
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line(
        "markers", "distributed: starts several processes (torch.distributed over gloo on CPU)"
    )
    # pytest-timeout (the `test` extra) applies no timeout unless one is configured; give every
    # test one, but let --timeout, PYTEST_TIMEOUT or an ini `timeout` override it.
    if (
        config.pluginmanager.hasplugin("timeout")
        and config.getoption("timeout") is None
        and "PYTEST_TIMEOUT" not in os.environ
        and not config.getini("timeout")
    ):
        config.option.timeout = DEFAULT_TEST_TIMEOUT_S


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server on a loopback port for the module's tests: the one `.ci/run`
    started (PERSEUS_TEST_POSTGRES_PORT), else one started here as the unprivileged `postgres`
    user. Where none can be had the tests skip, saying why -- except under CI (env CI=true),
    where they fail, as the Prometheus tests do: a CI run never passes without the server."""
    from postgres_server import ServerUnavailable, server_from_environment, start_server

    try:
        server = server_from_environment() or start_server()
    except ServerUnavailable as err:
        message = f"PostgreSQL server could not start here: {err}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; .ci/run starts one (PostgreSQL comes with the CI image)")
        pytest.skip(message)
    yield server
    server.stop()
