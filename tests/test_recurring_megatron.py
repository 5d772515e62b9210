"""Recurring Megatron job under the batch-size optimizer: `--perseus` with a `policy.batch_size`
section sets `--global-batch-size` from the store, end to end (the tiny GPT of
examples/megatron_gpt3 on megatron-core's pipeline schedules, 2 CPU processes over gloo,
simulated A100s), plus the flag conflicts that must fail with the flag's name.

Two runs of one job in the same processes: the first gets the default batch size 4; its target
(an `lm loss` of 0.5, out of reach in 5 iterations) is not reached, which prunes 4, so the
second run gets the next size down the pruning walk, 2. Each run's number of microbatches and
the schedule perseus-ext planned follow the store's batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "megatron_gpt3" / "pretrain_gpt3.py"
LAUNCHER = ROOT / "tests" / "megatron_cpu.py"
TINY = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "1",
        "--pipeline-model-parallel-size", "2"]
JOB = "megatron-recurring"


def _section(store: str) -> dict:
    return {
        "gpu": "sim:a100_sxm?noise=0&period=0.01",
        "warmup_iterations": 1,
        "candidate_clocks": [1410, 990],
        "simulated_workload": {"forward_seconds": [0.01, 0.015], "backward_seconds": [0.02, 0.03]},
        "policy": {"batch_size": {
            "store": store, "job_id": JOB, "batch_sizes": [2, 4], "default_batch_size": 4,
            "target_metric": {"name": "lm loss", "value": 0.5, "higher_is_better": False},
        }},
    }


@pytest.mark.distributed
def test_store_sets_the_global_batch_size_of_each_run(tmp_path):
    from perseus_ext.policies.batch_size import read_states

    store = f"sqlite:///{tmp_path / 'bso.db'}"
    config = tmp_path / "perseus.json"
    config.write_text(json.dumps(_section(store)))
    entries = [{"argv": TINY + ["--global-batch-size", "4", "--train-iters", "5", "--perseus",
                                "--perseus-config", str(config), "--metrics-file", str(tmp_path / f"run{i}.json")]}
               for i in range(2)]
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps(entries))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("PERSEUS_GPU", None)
    from runtime_helpers import free_port as _free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), str(LAUNCHER), "--runs", str(runs_file), str(SCRIPT)]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    planned = []
    for i in range(2):
        metrics = json.loads((tmp_path / f"run{i}.json").read_text())
        assert len(metrics["iterations"]) == 5  # trained to the end: the target is out of reach
        schedules = {json.dumps(s["megatron"]["schedule"]) for s in metrics["perseus"]}
        assert len(schedules) == 1  # both stages planned the same schedule
        planned.append(json.loads(schedules.pop())["microbatches"])
    assert planned == [4, 2]  # global batch 4 then 2, micro batch 1 x DP 1
    assert "trains with --global-batch-size 4 (prune)" in output
    assert "trains with --global-batch-size 2 (prune)" in output
    (state,) = read_states(store, JOB)
    assert state.num_runs == 2
    assert state.arms[4].not_reached == 1 and state.arms[2].not_reached == 1
    assert all(cost > 0 for arm in state.arms.values() for cost in arm.costs)


def _args(**overrides) -> argparse.Namespace:
    values = {"perseus": True, "micro_batch_size": 2, "global_batch_size": 4, "rampup_batch_size": None,
              "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("overrides, message", [
    ({"global_batch_size": 16}, "--global-batch-size 16 conflicts with perseus.policy.batch_size"),
    ({"rampup_batch_size": [2, 2, 100]}, "--rampup-batch-size conflicts with perseus.policy.batch_size"),
    ({"micro_batch_size": 4}, "batch_sizes [2] are not multiples of --micro-batch-size 4"),
])
def test_conflicting_flags_fail_with_their_name(tmp_path, overrides, message):
    from perseus_ext.adapters.megatron_args import apply_run_batch_size
    from perseus_ext.errors import ConfigError
    from perseus_ext.runtime import PerseusConfig

    config = PerseusConfig.from_dict({"enabled": True, **_section(str(tmp_path / "bso.db"))})
    with pytest.raises(ConfigError) as caught:
        apply_run_batch_size(_args(**overrides), config)
    assert message in str(caught.value)
    assert not (tmp_path / "bso.db").exists()  # refused before the store was asked
