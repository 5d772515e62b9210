"""Tests-only launcher: megatron-core on CPU (the example's `cpu_shims`) plus what only tests
need: several runs of a script in the same processes, and a deliberately wrong plan.

    torchrun ... tests/megatron_cpu.py --runs RUNS.json examples/megatron_gpt3/pretrain_gpt3.py

calls the script's `main(argv)` once per entry of RUNS.json (`[{"argv": [...], "env": {...}},
...]`) in the same processes (megatron's import and process-group start-up are paid once), then
its `shutdown()`. Without `--runs` it is the example's own launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "megatron_gpt3"))

import cpu_shims  # noqa: E402


@contextlib.contextmanager
def misplanned_schedules():
    """Make the Megatron adapter plan a wrong order (the last two computations of every stage
    swapped), as a megatron-core release that reorders its schedule would look to perseus-ext."""
    from perseus_ext.adapters import megatron_steps as adapter  # where the adapter builds its orders

    def swap_last_two(build):
        def build_wrong(*args, **kwargs):
            schedule = build(*args, **kwargs)
            orders = tuple(order[:-2] + (order[-1], order[-2]) for order in schedule.orders)
            return dataclasses.replace(schedule, orders=orders)

        return build_wrong

    saved = adapter.build_schedule, adapter.interleaved
    adapter.build_schedule, adapter.interleaved = map(swap_last_two, saved)
    try:
        yield
    finally:
        adapter.build_schedule, adapter.interleaved = saved


class _CpuGraph:
    """torch.cuda.CUDAGraph on a CPU: capture runs the work eagerly (so the first captured
    iteration computes as on a GPU), replay launches nothing -- on a real device the replay's
    kernels run without any Python, which is all perseus-ext sees of it. Counts replays."""

    replays = 0

    def register_generator_state(self, state) -> None:
        pass

    def replay(self) -> None:
        _CpuGraph.replays += 1


@contextlib.contextmanager
def cpu_cuda_graphs():
    """What megatron-core's FullCudaGraphWrapper needs of torch.cuda, on the CPU; the wrapper's
    class-level state (iteration counters, captured graphs) is reset before and after a run."""
    from unittest import mock

    from megatron.core import full_cuda_graph

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    @contextlib.contextmanager
    def capture(graph, **kwargs):
        yield

    def reset() -> None:
        wrapper = full_cuda_graph.FullCudaGraphWrapper
        wrapper.curr_iteration = {"training": 0, "validation": 0}
        wrapper.cuda_graph = {"training": None, "validation": None}
        wrapper.result = {"training": None, "validation": None}
        full_cuda_graph.StaticBufferLoader.static_buffers = {"training": [], "validation": []}

    reset()
    _CpuGraph.replays = 0
    with mock.patch("torch.cuda.CUDAGraph", _CpuGraph), mock.patch("torch.cuda.graph", capture), \
            mock.patch("torch.cuda.Stream", Stream), mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()), \
            mock.patch("torch.cuda.current_stream", lambda *a, **k: Stream()), \
            mock.patch.object(full_cuda_graph, "get_all_rng_states", lambda: {}):
        try:
            yield
        finally:
            print(f"cpu_cuda_graphs: {_CpuGraph.replays} replays", flush=True)
            reset()


def run_many(script: str, runs_file: str) -> None:
    """Call `script`'s `main(argv)` for each run in `runs_file`, then its `shutdown()`.

    A run may set environment variables (`env`, e.g. a simulated straggler) and ask for a
    wrong plan order (`"misplan": true`)."""
    with open(runs_file, encoding="utf-8") as handle:
        runs = json.load(handle)
    module = runpy.run_path(script, run_name="megatron_cpu_script")
    for run in runs:
        run_one(module, run)
    module["shutdown"]()


def run_one(module: dict, run: dict) -> None:
    """One run's `main(argv)` of a script loaded with `runpy.run_path`, under the run's
    environment variables and, on request, a misplanned order or CPU CUDA graphs."""
    saved_env = dict(os.environ)
    os.environ.update(run.get("env", {}))
    try:
        with contextlib.ExitStack() as stack:
            if run.get("misplan"):
                stack.enter_context(misplanned_schedules())
            if run.get("cpu_graphs"):
                stack.enter_context(cpu_cuda_graphs())
            module["main"](run["argv"])
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def main() -> None:
    """Launcher: `python tests/megatron_cpu.py [--runs FILE] SCRIPT ARGS...`."""
    if sys.argv[1:2] != ["--runs"]:
        cpu_shims.main()
        return
    if len(sys.argv) < 4:
        raise SystemExit("usage: megatron_cpu.py --runs RUNS.json SCRIPT")
    runs_file, script = sys.argv[2], sys.argv[3]
    cpu_shims.install()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    run_many(script, runs_file)


if __name__ == "__main__":
    main()
