"""Shared helpers of the runtime tests: a small config, a simulated GPU, an adapter-like
training loop that drives a `PerseusRuntime` for one stage, and a device marker the test
reaches by hand (controller and sequencer tests).

The lifecycle tests use a paced (wall-clock) simulated GPU: the device runs asynchronously like a
real one, so the controller's worker follows it by markers exactly as it would on hardware.
Workloads are a few milliseconds and the energy counter updates every 20 ms, so whole training
runs still take a few seconds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.measurement.gpu.timeline import DeviceMarker
from perseus_ext.runtime import PerseusConfig, PerseusRuntime

FORWARD_S, BACKWARD_S = 0.004, 0.008


class HandMarker(DeviceMarker):
    """A device marker the test reaches by hand; `at_s` is when the device reached it (None: not
    yet), on the host's clock as on the paced simulated device."""

    def __init__(self, at_s: float | None = None) -> None:
        self.at_s = at_s

    def reach(self, at_s: float | None = None) -> None:
        self.at_s = time.perf_counter() if at_s is None else at_s

    def query(self) -> bool:
        return self.at_s is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.query()

    def device_time_s(self) -> float | None:
        return self.at_s


def make_config(**overrides) -> PerseusConfig:
    section = {
        "enabled": True,
        "gpu": "sim:a100_sxm",  # tests pass their own simulated GPU object; this names its kind
        "warmup_iterations": 1,
        "clock_stride": 6,
        "straggler_check_interval": 3,
        "log_interval": 0,
        "solve_in_background": False,
        "simulated_workload": {"forward_seconds": FORWARD_S, "backward_seconds": BACKWARD_S},
        # Computations of tens of ms: the default clock-change budget (5 a second) would leave one
        # clock per stage; the budget has its own tests (test_clock_budget*.py).
        "solver": {"max_clock_changes_per_s": 0},
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


def train(runtime: PerseusRuntime, iterations: int, seed: int = 0, sleep_s: float = 0.0,
          after_iteration=None) -> None:
    """What an adapter does for one stage, with random blocking waits between computations
    (a real pipeline blocks on its neighbours). `sleep_s` adds wall time per iteration, for
    policies that follow the real clock (carbon traces); `after_iteration()` runs after each
    iteration's end, as an adapter's metrics writer does."""
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
        if after_iteration is not None:
            after_iteration()
        if sleep_s:
            time.sleep(sleep_s)


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_gloo_job(script: str, out_dir: Path, world_size: int, timeout_s: float) -> list[dict]:
    """Run `script <out_dir>` as `world_size` local gloo ranks (RANK/WORLD_SIZE/MASTER_* set);
    each rank writes `rank<r>.json` into `out_dir`, returned in rank order. A rank that fails or
    outlives `timeout_s` fails the test with its output."""
    port = free_port()
    package_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    processes = [subprocess.Popen([sys.executable, script, str(out_dir)], env=dict(env, RANK=str(rank)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world_size)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def model_profile(path: Path, gpu, forward_s: float, backward_s: float) -> str:
    """A one-stage profile of the simulated GPU's own model (exact times and energies at every
    6th clock), saved at `path`, so a runtime can skip profiling."""
    from perseus_ext.planning.profile import Profile

    rows = [{"stage": 0, "instruction": kind, "frequency": clock,
             "time": gpu.expected(seconds, clock)[0], "energy": gpu.expected(seconds, clock)[1]}
            for kind, seconds in (("forward", forward_s), ("backward", backward_s))
            for clock in gpu.supported_sm_clocks()[::6]]
    Profile.from_rows(rows).save(path)
    return str(path)


# Stage durations at the max clock of the hooked-schedule tests (megatron_hooked, full-iteration graphs).
STAGE_FORWARD_S = (0.004, 0.006)  # per stage: stage 1 is the busier one, stage 0 has slack
STAGE_BACKWARD_S = (0.008, 0.012)


def stage_profile(path: Path, gpu, stages: int) -> str:
    """A profile of the simulated GPU's own model for `stages` stages (every 6th clock)."""
    return profile_of_model(path, gpu, STAGE_FORWARD_S[:stages], STAGE_BACKWARD_S[:stages],
                            gpu.supported_sm_clocks()[::6])


def profile_of_model(path: Path, gpu, forward_s, backward_s, clocks) -> str:
    """Stage s's forward and backward (`forward_s[s]`, `backward_s[s]` seconds at the maximum
    clock) at each of `clocks`, from the simulated GPU's own model (exact times and energies),
    saved at `path`."""
    from perseus_ext.planning.profile import Profile

    rows = [{"stage": stage, "instruction": kind, "frequency": clock,
             "time": gpu.expected(seconds[stage], clock)[0], "energy": gpu.expected(seconds[stage], clock)[1]}
            for stage in range(len(forward_s))
            for kind, seconds in (("forward", forward_s), ("backward", backward_s))
            for clock in clocks]
    Profile.from_rows(rows).save(path)
    return str(path)
