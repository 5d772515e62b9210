"""Tests-only CPU shims that let megatron-core's real GPT model and pipeline schedules run on CPU.

megatron-core assumes CUDA in a handful of places (`device="cuda"` token counters in the
schedules, `torch.cuda.current_device()` buffers in p2p communication and tensor-parallel
layers, CUDA RNG trackers, `torch.cuda.synchronize()`). These shims redirect exactly those to
the CPU so the tests exercise megatron-core's own schedules over gloo. They are never imported by
the shipped package.

Usage as a launcher:

    torchrun --nproc-per-node 2 tests/megatron_cpu.py examples/megatron_gpt3/pretrain_gpt3.py ARGS

installs the shims, then runs the script as `__main__`. The tests use

    torchrun ... tests/megatron_cpu.py --runs RUNS.json examples/megatron_gpt3/pretrain_gpt3.py

which calls the script's `main(argv)` once per entry of RUNS.json (`[{"argv": [...],
"env": {...}}, ...]`) in the same processes (megatron's import and process-group start-up are
paid once), then its `shutdown()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import runpy
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device() indices
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device=cuda` of tensor factories and `.cuda()`/`.to("cuda")` to the CPU, and
    reports CPU tensors' `.type()` as CUDA types (megatron's optimizer asserts on them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuRngTracker:
    """Stand-in for megatron's CUDA RNG tracker: named states on the CPU generator."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return bool(self.states)

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


_MODE: _CudaToCpu | None = None


def install() -> None:
    """Install the shims in this process (idempotent)."""
    global _MODE
    if _MODE is not None:
        return
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()

    from megatron.core.tensor_parallel import random as mcore_random

    tracker = _CpuRngTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    mcore_random.initialize_rng_tracker = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: None

    _MODE = _CudaToCpu()
    _MODE.__enter__()


@contextlib.contextmanager
def misplanned_schedules():
    """Make the Megatron adapter plan a wrong order (the last two computations of every stage
    swapped), as a megatron-core release that reorders its schedule would look to perseus-ext."""
    from perseus_ext.adapters import megatron as adapter

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


def run_many(script: str, runs_file: str) -> None:
    """Call `script`'s `main(argv)` for each run in `runs_file`, then its `shutdown()`.

    A run may set environment variables (`env`, e.g. a simulated straggler) and ask for a
    wrong plan order (`"misplan": true`)."""
    with open(runs_file, encoding="utf-8") as handle:
        runs = json.load(handle)
    module = runpy.run_path(script, run_name="megatron_cpu_script")
    for run in runs:
        saved_env = dict(os.environ)
        os.environ.update(run.get("env", {}))
        with misplanned_schedules() if run.get("misplan") else contextlib.nullcontext():
            module["main"](run["argv"])
        os.environ.clear()
        os.environ.update(saved_env)
    module["shutdown"]()


def main() -> None:
    """Launcher: `python tests/megatron_cpu.py [--runs FILE] SCRIPT ARGS...`."""
    argv = sys.argv[1:]
    runs_file = None
    if argv[:1] == ["--runs"]:
        runs_file, argv = argv[1], argv[2:]
    if not argv:
        raise SystemExit("usage: megatron_cpu.py [--runs RUNS.json] SCRIPT [ARGS...]")
    install()
    script = argv[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if runs_file is not None:
        run_many(script, runs_file)
        return
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
