"""Shared helpers of the runtime tests: a small config, a simulated GPU, and an adapter-like
training loop that drives a `PerseusRuntime` for one stage.

The lifecycle tests use a paced (wall-clock) simulated GPU: the device runs asynchronously like a
real one, so the controller's worker follows it by markers exactly as it would on hardware.
Workloads are a few milliseconds and the energy counter updates every 20 ms, so whole training
runs still take a few seconds."""

from __future__ import annotations

import time

import numpy as np

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.runtime import PerseusConfig, PerseusRuntime

FORWARD_S, BACKWARD_S = 0.004, 0.008


def make_config(**overrides) -> PerseusConfig:
    section = {
        "enabled": True,
        "warmup_iterations": 1,
        "clock_stride": 6,
        "straggler_check_interval": 3,
        "log_interval": 0,
        "solve_in_background": False,
        "simulated_workload": {"forward_seconds": FORWARD_S, "backward_seconds": BACKWARD_S},
    }
    section.update(overrides)
    return PerseusConfig.from_dict(section)


def virtual_gpu(seed: int = 3, **options: str):
    """A simulated A100 on a virtual clock (single-threaded unit tests of measurement code)."""
    query = "&".join(f"{k}={v}" for k, v in {"pace": "0", **options}.items())
    return open_gpu(f"sim:a100_sxm?{query}", seed=seed)


def sim_gpu(seed: int = 3, **options: str):
    """A paced simulated A100 (asynchronous device, default clock-change latency) whose energy
    counter updates every 20 ms; options as in `open_gpu` specs."""
    query = "&".join(f"{k}={v}" for k, v in {"period": "0.02", **options}.items())
    return open_gpu(f"sim:a100_sxm?{query}", seed=seed)


def train(runtime: PerseusRuntime, iterations: int, seed: int = 0, sleep_s: float = 0.0) -> None:
    """What an adapter does for one stage, with random blocking waits between computations
    (a real pipeline blocks on its neighbours). `sleep_s` adds wall time per iteration, for
    policies that follow the real clock (carbon traces)."""
    rng = np.random.default_rng(seed)
    for _ in range(iterations):
        runtime.iteration_start()
        for computation in runtime.order:
            runtime.gpu.wait(float(rng.uniform(0.0, 0.004)))
            runtime.before_computation(computation.kind, computation.microbatch)
            runtime.after_computation(computation.kind, computation.microbatch)
        runtime.mark_compute_end()
        runtime.gpu.wait(0.005)  # optimizer step, data-parallel all-reduce
        runtime.iteration_end()
        if sleep_s:
            time.sleep(sleep_s)
