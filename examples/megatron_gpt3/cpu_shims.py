"""CPU shims that let megatron-core's real GPT model and pipeline schedules run on a CPU.

megatron-core assumes CUDA in a handful of places (`device="cuda"` token counters in the
schedules, `torch.cuda.current_device()` buffers in p2p communication and tensor-parallel
layers, CUDA RNG trackers, `torch.cuda.synchronize()`). These shims redirect exactly those to
the CPU so the tiny example trains through megatron-core's own schedules over gloo. They belong
to this example (and the tests that run it), never to the perseus_ext package.

Usage as a launcher (what run_tiny_cpu.sh does):

    torchrun --nproc-per-node 2 examples/megatron_gpt3/cpu_shims.py examples/megatron_gpt3/pretrain_gpt3.py ARGS

installs the shims, then runs the script as `__main__`.
"""

from __future__ import annotations

import contextlib
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


def main() -> None:
    """Launcher: `python cpu_shims.py SCRIPT ARGS...`."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: cpu_shims.py SCRIPT [ARGS...]")
    install()
    script = sys.argv[1]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
