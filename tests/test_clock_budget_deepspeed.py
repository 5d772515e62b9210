"""A real DeepSpeed job keeps its clock-change budget in every deployed iteration.

DeepSpeed's pipeline engine over gloo, 2 stages x 1 pipeline on paced simulated A100s (a
pipeline needs the devices' shared board, which virtual-time `pace=0` GPUs do not have), planned
on the simulated GPU's own model (a saved profile: no profiling) with
`perseus.solver.max_clock_changes_per_s` and `min_clock_hold_s`. Every clock the
runtime sets is logged with the device's time (tests/deepspeed_clock_budget_worker.py); in the
deployed iterations no rolling second holds more changes than the budget and no clock is held
shorter than the minimum. The same job's plans without the budget would break it (checked on
the planner), so the budget is what keeps the log within it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_helpers import profile_of_model

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.planning.energy import BLOCKING_POWER_W
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency"
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
ITERATIONS, MICROBATCHES = 9, 8  # deployed from iteration 1 (a saved profile): 8 deployed iterations
# Stage 0 is the slower one: stage 1's plan runs two clocks even at the fastest plan, changing
# about twice a second under the budget and at every computation without it.
FORWARD_S, BACKWARD_S = [0.060, 0.040], [0.120, 0.080]
CLOCKS_MHZ = [1410, 1305, 1200, 1095, 990, 885]
BUDGET = {"max_clock_changes_per_s": 4, "min_clock_hold_s": 0.25}


def model_profile(path: Path) -> str:
    return profile_of_model(path, open_gpu("sim:a100_sxm?pace=0"), FORWARD_S, BACKWARD_S, CLOCKS_MHZ)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def budgeted_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("clock-budget")
    profile = model_profile(out / "profile.csv")
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000,
        "perseus": {
            "enabled": True, "gpu": "sim:a100_sxm", "profile_path": profile, "candidate_clocks": CLOCKS_MHZ,
            "clock_stride": 1, "warmup_iterations": 1, "baseline_fraction": 0.0, "log_interval": 0,
            "solve_in_background": False, "blocking_power_w": BLOCKING_POWER_W["a100"],
            "log_path": str(out / "log-{rank}.jsonl"), "summary_path": str(out / "summary-{rank}.json"),
            "simulated_workload": {"forward_seconds": FORWARD_S, "backward_seconds": BACKWARD_S},
            "solver": BUDGET,
        },
    }
    (out / "ds_config.json").write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
         str(REPO / "tests/deepspeed_clock_budget_worker.py"), str(out / "ds_config.json"), str(out),
         str(ITERATIONS), str(MICROBATCHES)],
        cwd=out, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    return out, profile


@pytest.mark.distributed
def test_the_planner_needs_the_budget_here(budgeted_job) -> None:
    _, profile = budgeted_job
    unbudgeted = solve_frontier(one_f_one_b(2, MICROBATCHES), load_profile(profile), BLOCKING_POWER_W["a100"],
                                SolverOptions(max_clock_changes_per_s=0))
    budget = SolverOptions(**BUDGET).clock_budget
    assert not budget.allows(unbudgeted.fastest.clock.changes_per_s, unbudgeted.fastest.clock.shortest_hold_s)


@pytest.mark.distributed
def test_every_deployed_iteration_keeps_the_budget(budgeted_job) -> None:
    out, _ = budgeted_job
    judged = 0
    for rank in (0, 1):
        summary = json.loads((out / f"summary-{rank}.json").read_text())
        assert summary["fallback_reason"] is None and summary["final_phase"] == "deployed"
        log = json.loads((out / f"clocks{rank}.json").read_text())
        ends = log["iterations"]
        first = next(k for k, (phase, _) in enumerate(ends) if phase == "deployed")
        assert len(ends) - first >= 6  # deployed iterations to judge
        start = ends[first - 1][1]  # the device time the first deployed iteration starts from
        changes, clock = [], None
        for device_s, mhz in log["changes"]:
            if mhz != clock:
                if device_s >= start:
                    changes.append(device_s)
                clock = mhz
        assert changes, log["changes"]
        holds = [b - a for a, b in zip(changes, changes[1:])]
        assert all(hold >= BUDGET["min_clock_hold_s"] for hold in holds), holds
        most = max(sum(1 for t in changes if c <= t < c + 1.0) for c in changes)
        assert most <= BUDGET["max_clock_changes_per_s"], changes
        judged += len(holds)
    assert judged >= 6  # the plans do change clocks: there was something to judge
