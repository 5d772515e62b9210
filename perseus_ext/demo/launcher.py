"""Launching a comparison job under torchrun, with a timeout that kills the whole job."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from perseus_ext.demo.scenario import Scenario


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(scenario: Scenario, *, timeout_s: float = 600.0, quiet: bool = True) -> list[list[dict[str, Any]]]:
    """Run the scenario under torchrun; per-rank results (one entry per variant), by rank.

    A job that does not finish within `timeout_s` is killed (the whole process group), so a
    hang fails loudly instead of blocking.
    """
    out = Path(scenario.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("rank*.json"), *out.glob("log-*.jsonl")]:  # logs are appended to
        stale.unlink()
    scenario_path = out / "scenario.json"
    scenario_path.write_text(json.dumps(dataclasses.asdict(scenario)))
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", str(scenario.world_size), "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), "-m", "perseus_ext.demo.worker", "--worker", str(scenario_path),
    ]
    log_path = out / "torchrun.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"the demo job did not finish in {timeout_s:.0f} s; see {log_path}") from None
    if code != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"the demo job failed (exit code {code}); last output:\n{tail}")
    if not quiet:
        print(log_path.read_text())
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(scenario.world_size)]
