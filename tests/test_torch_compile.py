"""`torch.compile`d stage modules (inductor, on the CPU): do perseus-ext's hooks still bracket
each computation, one forward and one backward per microbatch, in the schedule's order?

They do, on both frameworks, because both call the compiled module from their own eager step
functions: DeepSpeed's ForwardPass/BackwardPass instructions (a real 2-stage PipelineEngine over
gloo, tests/deepspeed_compile_worker.py) and megatron-core's `forward_step`/`backward_step`
(its real 1F1B schedule, both ranks in one process, tests/megatron_shims.py). The compiled
forward runs inside the forward's bracket and the compiled backward (AOTAutograd's backward
graph, run by autograd) inside the backward's: each compiled block records, from eager code
around it, when its forward returned and when its weight's gradient was accumulated.
Compilation itself is the only extra cost, paid in the first (warm-up) iteration's forward and
backward; the plan is profiled and deployed as without compile.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPILE_TIMEOUT_S = 300  # inductor compiles each rank's blocks once (C++ kernels with gcc)
ITERATIONS = 14
PERSEUS = {
    "enabled": True,
    "gpu": "sim:a100_sxm?noise=0&period=0.01",
    "warmup_iterations": 1,
    "candidate_clocks": [1410, 1200, 990],
    "clock_stride": 1,
    "solve_in_background": False,
    "log_interval": 0,
    "straggler_check_interval": 5,
    "simulated_workload": {"forward_seconds": [0.004, 0.006], "backward_seconds": [0.008, 0.012]},
}


def bracketed(events: list, order: list[list], computes_per_step: int, iterations: int) -> list[tuple[str, int]]:
    """Check that every compiled computation ran inside perseus-ext's hooks of its own kind, and
    return the hooked (kind, microbatch) sequence. `events` mixes hook records
    ("before"|"after", kind, microbatch) with compute records ("forward"|"backward")."""
    hooked: list[tuple[str, int]] = []
    open_step: tuple[str, int] | None = None
    inside: list[str] = []
    for event in events:
        if isinstance(event, str):  # a compiled forward returned / a compiled backward ran
            assert open_step is not None, f"compiled {event} ran outside perseus-ext's hooks"
            assert event == open_step[0], f"compiled {event} ran inside the hooks of {open_step}"
            inside.append(event)
            continue
        what, kind, microbatch = event
        if what == "before":
            assert open_step is None, f"{event} before the hooks of {open_step} closed"
            open_step, inside = (kind, microbatch), []
        else:
            assert open_step == (kind, microbatch), f"{event} closes {open_step}"
            assert len(inside) == computes_per_step, (open_step, inside)  # every block of the stage
            hooked.append(open_step)
            open_step = None
    assert open_step is None
    assert hooked == [tuple(c) for c in order] * iterations  # one F and one B per microbatch, in order
    return hooked


# --------------------------------------------------------------------------- DeepSpeed
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency")
def test_deepspeed_hooks_bracket_compiled_stage_modules(tmp_path):
    from runtime_helpers import free_port

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000,
              "perseus": PERSEUS}
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO / "tests/deepspeed_compile_worker.py"), str(config_path), str(tmp_path), str(ITERATIONS)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["unique_graphs"] >= 1 and result["graph_breaks"] == 0, result  # compiled code ran
        bracketed(result["events"], result["order"], computes_per_step=2, iterations=ITERATIONS)
        assert result["fallback"] is None, result["fallback"]
        assert result["phase"] == "deployed"  # profiled and deployed through the same hooks


# --------------------------------------------------------------------------- megatron-core
class TracedBlock:
    """Built lazily (torch import inside the test): a compiled Linear+Tanh on megatron_shims'
    (1, 1, 1) activations that records into its rank's event list when the compiled forward
    returned and when the compiled backward accumulated the weight's gradient."""

    def __new__(cls, events: list):
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.block = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Tanh())
                self.block[0].weight.register_post_accumulate_grad_hook(lambda _: events.append("backward"))
                self.compiled = torch.compile(self.block, backend="inductor", dynamic=False)

            def forward(self, x):
                out = self.compiled(x)
                events.append("forward")
                return out

        return Block()


@pytest.mark.slow
def test_megatron_core_hooks_bracket_compiled_stage_modules(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")
    import torch
    from torch._dynamo.utils import counters

    from megatron_hooked import hooked_ranks, perseus_hooks
    from megatron_shims import TENSOR_SHAPE, cuda_factories_on_cpu, run_megatron_schedule

    stages, microbatches, iterations = 2, 4, 6
    ranks = hooked_ranks(tmp_path, stages, microbatches)
    blocks = {stage: TracedBlock(ranks[stage].events) for stage in range(stages)}
    counters.clear()
    with cuda_factories_on_cpu():  # compile in the main thread, under the rank threads' torch-function mode
        for block in blocks.values():
            block(torch.zeros(TENSOR_SHAPE, requires_grad=True)).sum().backward()
    for rank in ranks:
        rank.events.clear()
    compiled_graphs = counters["stats"]["unique_graphs"]
    assert compiled_graphs >= 1
    with perseus_hooks(ranks), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(iterations):  # each call is one training iteration of megatron-core's 1F1B
            run_megatron_schedule(stages, microbatches, stage_module=blocks.__getitem__, timeout_s=120)
    assert sum(counters["graph_break"].values()) == 0  # the compiled blocks ran whole, without recompiling
    for rank in ranks:
        order = [[c.kind.value, c.microbatch] for c in rank.runtime.order]
        bracketed(rank.events, order, computes_per_step=1, iterations=iterations)
        assert rank.runtime.fallback_reason is None, rank.runtime.fallback_reason
        assert rank.runtime.phase.value == "deployed"
        rank.runtime.controller.flush(5.0)
        planned = {int(c) for c in rank.runtime.plan.frequencies[rank.perseus.stage]}
        assert planned <= set(rank.gpu.clock_history) | {rank.gpu.max_sm_clock()}  # the plan's clocks were set
        rank.runtime.close()
        assert rank.gpu.locked_clock is None
