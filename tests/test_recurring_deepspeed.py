"""Recurring DeepSpeed pipeline job under the batch-size optimizer, end to end, on SQLite and on
PostgreSQL: real torchrun processes over gloo, simulated A100s, the `"perseus"` key alone.

Seven runs of one job (2 stages, micro batch 2, DP 1; candidates 4, 8, 16, 32, default 16) in
the same two processes (tests/recurring_worker.py). The job's scripted convergence curve
(`STEPS_TO_TARGET`) makes batch size 4 hopeless, so its run must be stopped by its cost limit;
every other size reaches the target. Pruning then walks 16, 8, 4 (stopped: prunes 4), 32, and a
second round 16, 8, 32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from runtime_helpers import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency"
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
JOB = "recurring-e2e"
SIZES = [4, 8, 16, 32]
DEFAULT = 16
STEPS_TO_TARGET = {"4": 400, "8": 8, "16": 10, "32": 4}
RUNS = 7
PRUNING_ORDER = [16, 8, 4, 32, 16, 8, 32]


def launch(out_dir: Path, store: str) -> list[list[dict]]:
    """Seven runs of the job under torchrun; every rank's runs, by rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "out_dir": str(out_dir),
        "runs": RUNS,
        "timeout_s": LAUNCH_TIMEOUT_S - 30,
        "micro_batch": 2,
        "max_iterations": 400,
        "steps_to_target": STEPS_TO_TARGET,
        "perseus": {
            "enabled": True,
            "gpu": "sim:a100_sxm?switch_ms=8&transition_ms=4",
            "warmup_iterations": 2,
            "candidate_clocks": [1410, 1200, 990],
            "log_interval": 0,
            "control_timeout_s": 120.0,
            "profile_path": str(out_dir / "profile.csv"),  # the first run profiles, the others reuse it
            "solver": {"min_grid_points": 300},
            "simulated_workload": {"forward_seconds": 0.004, "backward_seconds": 0.008},
            "policy": {"batch_size": {
                "store": store, "job_id": JOB, "batch_sizes": SIZES, "default_batch_size": DEFAULT,
                "beta": 5.0, "seed": 0,
                "target_metric": {"name": "val_score", "value": 1.0, "higher_is_better": True},
            }},
        },
    }
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(REPO / "tests" / "recurring_worker.py"), str(spec_path)]
    log_path = out_dir / "torchrun.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"the recurring job did not finish in {LAUNCH_TIMEOUT_S} s; see {log_path}") from None
    assert code == 0, log_path.read_text()[-5000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def check_recurring_job(store: str, ranks: list[list[dict]]) -> None:
    from perseus_ext.policies.batch_size import read_states

    runs, other = ranks
    # Every rank trained with the batch size rank 0 got from the store.
    assert [r["batch_size"] for r in runs] == [r["batch_size"] for r in other]
    assert [r["batch_size"] for r in runs] == PRUNING_ORDER, [(r["batch_size"], r["outcome"]) for r in runs]
    for run in runs + other:
        # global = micro 2 x GAS x DP 1; the schedule the runtime planned has GAS microbatches
        assert run["gradient_accumulation_steps"] * 2 == run["batch_size"]
        assert run["engine_micro_batches"] == run["schedule_microbatches"] == run["gradient_accumulation_steps"]
        assert run["clocks_restored"]
    # The profile saved by run 1 (8 microbatches) planned the long stopped run's own schedule
    # (2 microbatches): its frontier was solved and deployed before the stop.
    why = {key: runs[2].get(key) for key in ("final_phase", "fallback_reason", "solve_error", "profiling_iterations",
                                            "phase_iterations", "iterations")}
    assert runs[2]["final_phase"] == "deployed" and runs[2]["frontier_plans"] >= 1, why
    outcomes = [r["outcome"] for r in runs]
    assert outcomes == [r["outcome"] for r in other]  # every rank stopped at the same boundary
    assert outcomes == ["reached", "reached", "stopped", "reached", "reached", "reached", "reached"]
    assert [r["iterations"] for r in runs] == [r["iterations"] for r in other]
    stopped = runs[2]
    assert stopped["iterations"] < STEPS_TO_TARGET["4"] and "stopped early" in stopped["stop_message"]
    assert stopped["report"]["outcome"] == "stopped" and stopped["report"]["cost"] > stopped["cost_limit"]
    assert runs[0]["cost_limit"] is None and all(r["cost_limit"] is not None for r in runs[1:])
    reports = [r["report"] for r in runs]
    assert [r["outcome"] for r in reports] == outcomes
    assert all(r["energy_j"] > 0 and r["time_s"] > 0 for r in reports)
    # the store holds exactly these runs, and its best batch size is the cheapest by their costs
    (state,) = read_states(store, JOB)
    assert state.num_runs == RUNS
    costs: dict[int, list[float]] = {}
    for run in runs:
        if run["report"]["outcome"] == "reached":
            costs.setdefault(run["batch_size"], []).append(run["report"]["cost"])
    for size, arm in state.arms.items():
        mine = [r["report"]["cost"] for r in runs if r["batch_size"] == size]
        assert sorted(arm.costs) == pytest.approx(sorted(mine))
    cheapest = min(costs, key=lambda size: statistics.fmean(costs[size]))
    assert state.best_batch_size == cheapest
    assert state.arms[4].pruned and state.arms[4].stopped == 1
    print(f"\n{store.split(':')[0]}: " + "; ".join(
        f"B={r['batch_size']} {r['report']['outcome']} {r['iterations']} it {r['report']['time_s']:.2f} s "
        f"{r['report']['energy_j']:.0f} J cost {r['report']['cost']:.0f}" for r in runs) + f"; best {state.best_batch_size}")


@pytest.mark.distributed
def test_recurring_job_on_sqlite(tmp_path):
    store = f"sqlite:///{tmp_path / 'state' / 'bso.db'}"
    check_recurring_job(store, launch(tmp_path / "job", store))


@pytest.mark.distributed
def test_recurring_job_on_postgresql(tmp_path, postgres):
    store = postgres.create_database(f"bso_{uuid.uuid4().hex[:12]}")
    check_recurring_job(store, launch(tmp_path / "job", store))
