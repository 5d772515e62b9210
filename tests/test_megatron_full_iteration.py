"""megatron-core's full-iteration CUDA graph (`FullCudaGraphWrapper`, what `--cuda-graph-impl
full_iteration` wraps the schedule in) with perseus-ext: each wrapper call is one iteration,
and the plan deployed is stage-constant, set between replays.

The example trains the tiny GPT with PP=2 on CPU over gloo (examples/megatron_gpt3). On a CPU
the wrapper's CUDA calls are stood in for by tests/megatron_cpu.py's `cpu_cuda_graphs`: its eager
warm-up iterations and the capture run megatron's schedule for real, a replay launches nothing
(on a GPU the replay's kernels run without any Python, which is all perseus-ext sees of it); the
simulated GPUs run each iteration's work. A first run profiles the job without graphs and saves
the profile; the graphed run solves from it, since a replay cannot be profiled per computation.
Both are runs of test_megatron.py's two-process job (its PP=2 layout: `optimize` saves the
profile, `graphed` is this file's run), so megatron's start-up is paid once for both files."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

from test_megatron import GRAPHED_ITERATIONS as ITERATIONS  # noqa: E402
from test_megatron import GRAPHED_WARMUP_STEPS as WARMUP_STEPS  # noqa: E402
from test_megatron import shared_two_process_job  # noqa: E402

from perseus_ext.planning.frontier import Frontier  # noqa: E402
from perseus_ext.planning.stage_constant import is_stage_constant  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # run alone, this file starts the whole shared job


@pytest.fixture(scope="module")
def graphed(tmp_path_factory):
    return shared_two_process_job(tmp_path_factory)["pp2"]


@pytest.mark.slow
@pytest.mark.distributed
def test_full_iteration_graph_job_deploys_a_stage_constant_plan_between_replays(graphed):
    run = graphed["graphed"]
    output = graphed["output"]
    assert "full-iteration CUDA graph (--cuda-graph-impl full_iteration)" in output
    replays = [int(n) for n in re.findall(r"cpu_cuda_graphs: (\d+) replays", output)]
    assert replays and all(n == ITERATIONS - WARMUP_STEPS for n in replays), replays  # capture + replays
    assert len(run.summaries) == 2  # one per rank of the 2-stage pipeline
    for summary in run.summaries:
        assert summary["fallback_reason"] is None, summary["fallback_reason"]
        assert summary["profiling_iterations"] == 0  # solved from the saved profile
        assert summary["final_phase"] == "deployed"
        assert summary["iterations"] == ITERATIONS  # one per wrapper call, eager or replayed
        assert summary["silent_hooks"]["episodes"] == []
        assert summary["deployed"]["iterations"] > 0
    frontier = Frontier.load(graphed["dir"] / "frontier.json")
    assert all(is_stage_constant(plan) for plan in frontier.plans)
    deployed = [r for r in run.log if r["phase"] == "deployed"]
    assert {r["iteration"] for r in deployed} >= set(range(WARMUP_STEPS + 2, ITERATIONS))  # replayed iterations run the plan
    print(json.dumps({"replays": replays, "plans": len(frontier.plans),
                      "fastest_clocks": [row[0] for row in frontier.fastest.frequencies.tolist()]}))
