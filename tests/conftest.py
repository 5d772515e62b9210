"""Settings shared by every test: markers, a default per-test timeout so a hang fails CI, and how
pytest-xdist shares the tests out between its workers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

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


# Workers for `-n auto`: most of the suite's time is spent in training jobs whose simulated GPUs
# sleep through their computations, so a second worker runs the short tests beside them; more
# workers would only wait, as one training job runs at a time.
MAX_AUTO_WORKERS = 2
# A file whose tests read another file's training job runs on that file's worker, which starts
# the job once for both.
SHARED_JOB_FILES = {"test_megatron_full_iteration.py": "test_megatron.py"}
JOB_GROUPS_KEY = "perseus_job_groups_dir"  # where each worker writes which of its groups start jobs


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS))


def _group_of(nodeid: str) -> str:
    """The file a test belongs to, or the file whose job it shares."""
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return SHARED_JOB_FILES.get(file, file)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """On the controller, per worker: the directory the worker reports its job groups in."""
    config = node.config
    if not hasattr(config, "_perseus_job_groups_dir"):
        config._perseus_job_groups_dir = tempfile.TemporaryDirectory(prefix="perseus-job-groups-")
    node.workerinput[JOB_GROUPS_KEY] = config._perseus_job_groups_dir.name


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_perseus_job_groups_dir"):
        config._perseus_job_groups_dir.cleanup()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Each group (`_group_of`) runs whole on one worker, so a module's fixture, often a whole
    training job, starts once. Groups that start jobs (a test marked `distributed`) run one at a
    time, the other workers taking short tests meanwhile: the jobs' timing claims then see at most
    one other busy core, as in a one-process run beside any other load. The groups are
    the scheduler's own rather than `xdist_group` marks under `--dist loadgroup`: that mode tags a
    node id that pytest 9.2 no longer reads, and then silently spreads a group over workers."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        job_groups: frozenset[str] = frozenset()  # the workers' reports, read once all collected

        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

        def schedule(self) -> None:
            if self.collection is None and hasattr(config, "_perseus_job_groups_dir"):
                reports = Path(config._perseus_job_groups_dir.name).glob("*.json")
                self.job_groups = frozenset(g for report in reports for g in json.loads(report.read_text()))
            super().schedule()

        def _job_running_elsewhere(self, node) -> bool:
            """Whether another worker has a job group not yet done. A worker's own does not count:
            it holds its last test until it gets more work, so it must be free to take some."""
            return any(scope in self.job_groups and not all(unit.values())
                       for other, work in self.assigned_work.items() if other is not node
                       for scope, unit in work.items())

        def _assign_work_unit(self, node) -> None:
            """The first group in collection order that may start now; none while a job group
            runs on another worker and only job groups are left."""
            blocked = self._job_running_elsewhere(node)
            scope = next((s for s in self.workqueue if not (blocked and s in self.job_groups)), None)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            # A worker refused a job group while another ran holds its last test (xdist runs it
            # once it has the next one or is shut down): offer it work again.
            for other in self.nodes:
                if other is not node and not other.shutting_down:
                    self._reschedule(other)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems gave
    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist's workers, groups that start jobs (`distributed`) or are `slow` are collected
    first, so they are handed out first: the run then ends with short tests on every worker, not
    with one long job on one. Each worker tells the controller which groups start jobs."""
    if not hasattr(config, "workerinput"):
        return
    heaviness: dict[str, int] = {}
    for item in items:
        weight = 0 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 2
        group = _group_of(item.nodeid)
        heaviness[group] = min(heaviness.get(group, 2), weight)
    items.sort(key=lambda item: heaviness[_group_of(item.nodeid)])  # stable: each group keeps its order
    if JOB_GROUPS_KEY in config.workerinput:
        report = Path(config.workerinput[JOB_GROUPS_KEY]) / f"{config.workerinput['workerid']}.json"
        report.write_text(json.dumps(sorted(g for g, weight in heaviness.items() if weight == 0)))


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
