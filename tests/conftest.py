"""Settings shared by every test: markers, a default per-test timeout so a hang fails CI, and how
pytest-xdist shares the tests out between its workers."""

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


# Workers for `-n auto` (pyproject.toml's addopts): most of the suite's time is spent in training
# jobs whose simulated GPUs sleep through their computations, so two workers on two cores keep
# both busy; more than four would run that many multi-process jobs at once.
MAX_AUTO_WORKERS = 4
# A file whose tests read another file's training job runs on that file's worker, which starts
# the job once for both.
SHARED_JOB_FILES = {"test_megatron_full_iteration.py": "test_megatron.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS))


def _group_of(nodeid: str) -> str:
    """The file a test belongs to, or the file whose job it shares."""
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return SHARED_JOB_FILES.get(file, file)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Each group (`_group_of`) runs whole on one worker, so a module's fixture, often a whole
    training job, starts once; groups are handed out in collection order. The groups are the
    scheduler's own rather than `xdist_group` marks under `--dist loadgroup`: that mode tags a
    node id that pytest 9.2 no longer reads, and then silently spreads a group over workers."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems gave
    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist's workers, groups that start processes (`distributed`) or are `slow` are collected
    first, so they are handed out first: the run then ends with short tests on every worker, not
    with one long job on one."""
    if not hasattr(config, "workerinput"):
        return
    heaviness: dict[str, int] = {}
    for item in items:
        weight = 0 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 2
        group = _group_of(item.nodeid)
        heaviness[group] = min(heaviness.get(group, 2), weight)
    items.sort(key=lambda item: heaviness[_group_of(item.nodeid)])  # stable: each group keeps its order


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
