"""Throw-away Prometheus and Pushgateway servers (Debian's `prometheus` and
`prometheus-pushgateway` packages) on loopback ports, with a temporary config and data directory;
never the system service. `.ci/run` installs both. Where a binary is missing the tests skip with
the install command, except under CI (env CI=true), where they fail: a CI run never passes
without the real server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

START_TIMEOUT_S = 60
INSTALL = "apt-get install -y prometheus prometheus-pushgateway"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports (a port per local rank)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                for offset in range(1, count):
                    b.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed ({INSTALL})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; .ci/run installs it")
        pytest.skip(message)
    return path


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            _get(url, 1.0)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


@dataclass
class PrometheusServer:
    url: str

    def query(self, expression: str, at: float | None = None) -> list[dict[str, Any]]:
        """/api/v1/query: the result vector (or matrix, for a range selector)."""
        params = {"query": expression, **({"time": f"{at:.3f}"} if at is not None else {})}
        answer = json.loads(_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"))
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expression)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.3)


@dataclass
class Pushgateway:
    url: str
    address: str


def _run(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port_outside(reserved: range) -> int:
    """A free port outside `reserved` (ports chosen earlier that their servers bind later: the
    OS may hand a just-released port out again)."""
    while (port := free_port()) in reserved:
        continue
    return port


def start_pushgateway(directory: Path, reserved: range = range(0)) -> Iterator[Pushgateway]:
    executable = binary("prometheus-pushgateway")
    port = free_port_outside(reserved)
    log = directory / "pushgateway.log"
    process = _run([executable, f"--web.listen-address=127.0.0.1:{port}"], log)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/-/ready", process, log)
        yield Pushgateway(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}")
    finally:
        _stop(process)


def start_prometheus(directory: Path, targets: list[str], scrape_interval: str = "250ms",
                     reserved: range = range(0)) -> Iterator[PrometheusServer]:
    """Prometheus scraping `targets` (host:port) with honor_labels (the exporters' `job`)."""
    executable = binary("prometheus")
    port = free_port_outside(reserved)
    config = directory / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
        "scrape_configs": [{"job_name": "perseus", "honor_labels": True,
                            "static_configs": [{"targets": targets}]}],
    }))
    log = directory / "prometheus.log"
    process = _run([executable, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}"], log)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/-/ready", process, log)
        yield PrometheusServer(f"http://127.0.0.1:{port}")
    finally:
        _stop(process)
