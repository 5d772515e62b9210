"""Per-layer CUDA graphs (`--cuda-graph-impl local|transformer_engine`) on megatron-core's real
1F1B schedule, as far as a CPU allows: hooks and device markers still pair with computations and
the plan's clocks are deployed per computation exactly as without graphs.

megatron-core's TransformerConfig carries the graph options (what `--cuda-graph-impl ...` sets on
the model), so its schedule takes the per-layer-graph path: with `local` graphs every schedule
call ends in `create_cudagraphs()` (counted here; it captures the layers recorded during the first
step). The layers' own graph runners (`CudaGraphManager`, Transformer Engine's
`make_graphed_callables`) need a CUDA device, so on the CPU no layer is recorded and the captures
themselves are not run: the per-computation kernels a replay launches are, to the host, one call
inside the same forward_step / backward_step, which is what perseus-ext hooks (the H200 run in
docs/device.md measured the markers on real graphed layers). The adapter detects the mode from
the same TransformerConfig (`adopt_execution`, as at the first iteration) and keeps optimize mode.
Both ranks run in one process (tests/megatron_shims.py) with the adapter's own wrappers and a
runtime per rank on paced simulated A100s (tests/megatron_hooked.py), deploying from a saved
profile.
"""

from __future__ import annotations

import logging
import warnings
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

from megatron.core.pipeline_parallel import schedules  # noqa: E402
from megatron.core.transformer.enums import CudaGraphScope  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_hooked import hooked_ranks, perseus_hooks  # noqa: E402
from megatron_shims import TENSOR_SHAPE, run_megatron_schedule  # noqa: E402
from test_torch_compile import bracketed  # noqa: E402

from perseus_ext.adapters.megatron_graphs import GraphMode  # noqa: E402

STAGES, MICROBATCHES, ITERATIONS = 2, 4, 6
GRAPH_OPTIONS = {  # what each flag sets on megatron-core 0.16's TransformerConfig
    "none": ({}, GraphMode.NONE),
    "--cuda-graph-impl local": ({"cuda_graph_impl": "local"}, GraphMode.PER_LAYER_LOCAL),
    "--enable-cuda-graph": ({"enable_cuda_graph": True}, GraphMode.PER_LAYER_LOCAL),
    "--cuda-graph-impl transformer_engine --cuda-graph-scope attn":
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": [CudaGraphScope.attn]}, GraphMode.PER_LAYER_TE),
}


def model_config(options: dict) -> TransformerConfig:
    with warnings.catch_warnings():  # megatron 0.16 warns about its own cuda_graph_scope default
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return TransformerConfig(num_layers=STAGES, hidden_size=TENSOR_SHAPE[2], num_attention_heads=1,
                                 pipeline_model_parallel_size=STAGES, pipeline_dtype=torch.float32, **options)


def train(tmp_path, options: dict, caplog) -> dict:
    """ITERATIONS of megatron-core's 1F1B with perseus-ext's hooks; what each rank saw."""
    caplog.clear()
    ranks = hooked_ranks(tmp_path, STAGES, MICROBATCHES, model_config=model_config(options))
    with perseus_hooks(ranks), \
            mock.patch.object(schedules, "create_cudagraphs", wraps=schedules.create_cudagraphs) as create:
        for _ in range(ITERATIONS):
            run_megatron_schedule(STAGES, MICROBATCHES, config_options=options, timeout_s=60)
    seen = {"graph_captures_asked": create.call_count, "ranks": [], "log": caplog.text}
    for rank in ranks:
        runtime = rank.runtime
        order = [[c.kind.value, c.microbatch] for c in runtime.order]
        hooked = bracketed(rank.events, order, computes_per_step=0, iterations=ITERATIONS)
        runtime.controller.flush(5.0)
        deployed = [r for r in runtime.history if r.setting.plan is not None]
        seen["ranks"].append({
            "mode": rank.perseus.execution.graph_mode, "config_mode": rank.perseus._config.mode,
            "hooked": hooked, "fallback": runtime.fallback_reason, "phase": runtime.phase.value,
            "plan": [int(c) for c in runtime.plan.frequencies[rank.perseus.stage]],
            "clocks_set": {c for c in rank.gpu.clock_history if c is not None},
            "deployed_iterations": len(deployed),
            "coverage_known": all(r.coverage is not None for r in deployed),
        })
        runtime.close()
        assert rank.gpu.locked_clock is None  # default clocks restored
    return seen


def test_per_layer_graphs_pair_hooks_and_markers_and_deploy_per_computation_as_without(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="perseus_ext")
    runs = {}
    for flags, (options, mode) in GRAPH_OPTIONS.items():
        run_dir = tmp_path / f"run{len(runs)}"
        run_dir.mkdir()
        runs[flags] = run = train(run_dir, options, caplog)
        local = options.get("cuda_graph_impl") == "local" or options.get("enable_cuda_graph")
        # megatron-core took the per-layer-graph path: one create_cudagraphs() per schedule call
        assert run["graph_captures_asked"] == (STAGES * ITERATIONS if local else 0), flags
        assert ("per-layer CUDA graphs" in run["log"]) is (mode is not GraphMode.NONE), flags  # one info line per rank
        assert "WARNING" not in run["log"] and "ERROR" not in run["log"], run["log"]
        assert len(run["ranks"]) == STAGES, flags
        for rank in run["ranks"]:
            assert rank["mode"] is mode, flags
            assert rank["config_mode"] == "optimize"  # per-layer graphs keep per-computation plans
            assert rank["fallback"] is None and rank["phase"] == "deployed", (flags, rank["fallback"])
            assert rank["deployed_iterations"] >= 2 and rank["coverage_known"]  # after warm-up and solve
            assert set(rank["plan"]) - {max(rank["plan"])} <= rank["clocks_set"], (flags, rank)  # set per computation
            assert rank["clocks_set"] <= set(rank["plan"]), (flags, rank)  # and nothing else
    baseline = runs["none"]["ranks"]
    for flags, run in runs.items():  # the same hooks and plan as without graphs
        for rank, plain in zip(run["ranks"], baseline, strict=True):
            assert rank["hooked"] == plain["hooked"], flags
            assert rank["plan"] == plain["plan"], flags  # (and each run set the plan's clocks, above)
