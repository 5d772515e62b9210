"""Schedule changes and non-pipeline engines.

`PerseusRuntime.reschedule` (what `set_train_batch_size()` and Megatron's batch-size ramp-up
lead to) and `PerseusRuntime.reprofile` (what `set_train_micro_batch_size()` leads to) are checked on a single-process runtime with a virtual-clock simulated GPU; the DeepSpeed
pieces run `examples/deepspeed/train.py` under torchrun over gloo with simulated A100s: a pipeline
engine whose batch size changes after deployment, and a plain (non-pipeline) engine in observe
and power-limit modes, which is all a job without a pipeline can use. Jobs whose claims hold under
each other's load (phases at known iterations, the frontier's own times, exit codes) are launched
side by side, so their start-ups overlap.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from perseus_ext.errors import PerseusError
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime, Phase

from runtime_helpers import make_config, sim_gpu, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
FAST_PROFILING = {
    "gpu": "sim:a100_sxm?noise=0&period=0.01",  # a fine energy counter: few profiling iterations
    "warmup_iterations": 1,
    "candidate_clocks": [1410, 1200, 990],
    "clock_stride": 1,
    "solve_in_background": False,
    "log_interval": 0,
}


# --------------------------------------------------------------------------- runtime
@pytest.mark.distributed
def test_reschedule_resolves_for_a_new_schedule_and_reuses_a_cached_frontier():
    four, six = build_schedule("1f1b", 1, 4), build_schedule("1f1b", 1, 6)
    runtime = PerseusRuntime(make_config(), schedule=four, stage=0, gpu=sim_gpu())
    try:
        train(runtime, 20)
        assert runtime.phase is Phase.DEPLOYED
        first = runtime.frontier

        runtime.reschedule(six)
        assert runtime.phase is Phase.SOLVING and len(runtime.order) == 12
        train(runtime, 2)
        assert runtime.phase is Phase.DEPLOYED and runtime.fallback_reason is None
        assert runtime.frontier is not first
        assert runtime.frontier.fastest.time > first.fastest.time  # 6 microbatches take longer

        runtime.reschedule(four)  # back to a schedule solved before: no new solve
        train(runtime, 2)
        assert runtime.phase is Phase.DEPLOYED and runtime.frontier is first
        assert runtime.solve_outcome.solve_s == 0.0

        runtime.reschedule(four)  # the same schedule changes nothing
        assert runtime.phase is Phase.DEPLOYED
        with pytest.raises(PerseusError, match="stages"):
            runtime.reschedule(build_schedule("1f1b", 2, 4))
    finally:
        runtime.close()


@pytest.mark.distributed
def test_reschedule_while_profiling_keeps_the_measurements():
    runtime = PerseusRuntime(make_config(), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    try:
        train(runtime, 2)
        assert runtime.phase is Phase.PROFILING
        profiled = runtime.profiling_iterations
        runtime.reschedule(build_schedule("1f1b", 1, 3))
        train(runtime, 20)
        assert runtime.phase is Phase.DEPLOYED and runtime.fallback_reason is None
        assert runtime.profiling_iterations > profiled
        assert runtime.frontier.fastest.time > 0 and runtime.schedule.num_microbatches == 3
    finally:
        runtime.close()


def train_until_deployed(runtime: PerseusRuntime, max_iterations: int = 40) -> None:
    for _ in range(max_iterations):
        train(runtime, 1)
        if runtime.phase is Phase.DEPLOYED:
            return
    raise AssertionError(f"not deployed after {max_iterations} iterations: {runtime.phase}")


@pytest.mark.distributed
def test_reprofile_measures_the_new_work_and_deploys_its_frontier(tmp_path):
    path = tmp_path / "profile.csv"
    runtime = PerseusRuntime(make_config(profile_path=str(path)), schedule=build_schedule("1f1b", 1, 4),
                             stage=0, gpu=sim_gpu())
    try:
        runtime.reprofile("still warming up")  # nothing measured yet: nothing to redo
        assert runtime.phase is Phase.WARMUP
        train_until_deployed(runtime)
        first, saved = runtime.frontier, path.read_bytes()
        changed_at = runtime.iteration

        runtime.gpu.slowdown = 2.0  # every computation now does twice the work
        runtime.reprofile("micro batch 4 -> 8")
        assert runtime.phase is Phase.WARMUP and runtime.frontier is None
        train_until_deployed(runtime)
        assert runtime.fallback_reason is None
        assert 1.7 < runtime.frontier.fastest.time / first.fastest.time < 2.3  # measured, not reused
        phases = [record.phase for record in runtime.history if record.iteration >= changed_at]
        assert phases[0] is Phase.WARMUP and Phase.PROFILING in phases
        assert path.read_bytes() == saved  # profile_path keeps the job's configured profile

        runtime.reschedule(build_schedule("1f1b", 1, 6))  # a cached frontier of the old work is gone
        train_until_deployed(runtime)
        assert runtime.solve_outcome.solve_s > 0.0
    finally:
        runtime.close()


def test_reprofile_leaves_observe_mode_alone():
    runtime = PerseusRuntime(make_config(mode="observe"), schedule=build_schedule("1f1b", 1, 4),
                             stage=0, gpu=sim_gpu())
    try:
        train(runtime, 2)
        runtime.reprofile("micro batch 4 -> 8")
        train(runtime, 2)
        assert runtime.phase is Phase.OBSERVING and runtime.fallback_reason is None
    finally:
        runtime.close()


def train_steadily(runtime: PerseusRuntime, iterations: int) -> None:
    """An adapter's hooks with no host-side waits between computations (a busy pipeline)."""
    for _ in range(iterations):
        runtime.iteration_start()
        for computation in runtime.order:
            runtime.before_computation(computation.kind, computation.microbatch)
            runtime.after_computation(computation.kind, computation.microbatch)
        runtime.mark_compute_end()
        runtime.gpu.wait(0.005)  # optimizer step
        runtime.iteration_end()


@pytest.mark.distributed
def test_a_model_that_misjudges_the_measured_iteration_is_warned_about(tmp_path, caplog):
    """A saved profile that halves every computation (as the per-chunk bug did for V = 2) makes
    the frontier model half the measured compute time: one warning says so. The profile the job
    measured itself never models the iteration too short (its per-computation framework
    overhead, larger on a loaded machine, can only lengthen the model)."""
    schedule = build_schedule("1f1b", 1, 4)
    path = tmp_path / "profile.csv"
    caplog.set_level(logging.WARNING, logger="perseus_ext")
    runtime = PerseusRuntime(make_config(profile_path=str(path)), schedule=schedule, stage=0, gpu=sim_gpu())
    for _ in range(60):  # profiling repeats what a loaded machine disturbed: ~15 iterations, or more
        train_steadily(runtime, 1)
        if runtime.phase is Phase.DEPLOYED:
            break
    train_steadily(runtime, 6)  # the model check compares deployed iterations with the frontier
    runtime.close()
    assert runtime.phase is Phase.DEPLOYED
    assert not [r for r in caplog.records if "the frontier models" in r.getMessage() and "(+" in r.getMessage()]
    caplog.clear()

    load_profile(path).scaled(0.5, 0.5).save(path)
    halved = PerseusRuntime(make_config(profile_path=str(path)), schedule=schedule, stage=0, gpu=sim_gpu())
    train_steadily(halved, 10)
    halved.close()
    warnings = [r.getMessage() for r in caplog.records if "the frontier models" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "(+" in warnings[0]  # measured about twice the model


# --------------------------------------------------------------------------- DeepSpeed
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is an optional dependency"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """A torchrun job of the example (or of a test worker), started and not yet waited for."""

    process: subprocess.Popen
    directory: Path
    started_s: float  # time.monotonic() at the start

    def finish(self) -> subprocess.CompletedProcess:
        """Wait for the job; one that outlives LAUNCH_TIMEOUT_S (from its start: jobs launched
        side by side share the time) is killed with its ranks and fails."""
        try:
            stdout, stderr = self.process.communicate(
                timeout=max(1.0, LAUNCH_TIMEOUT_S - (time.monotonic() - self.started_s)))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the launcher and its ranks, in their own session
            stdout, stderr = self.process.communicate()
            raise AssertionError(f"the job did not finish within {LAUNCH_TIMEOUT_S} s:\n{stderr[-3000:]}") from None
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)


def start_torchrun(directory: Path, script: Path, *args: str, nproc: int = 2) -> Launch:
    """`script` under torchrun over gloo in `directory`, in its own session (killed as a whole)."""
    directory.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started_s = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_port", str(_free_port()), str(script), *args],
        cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    return Launch(process, directory, started_s)


def example_config(directory: Path, perseus: dict) -> Path:
    """examples/deepspeed's config with `perseus` merged into its section, written to `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((REPO / "examples/deepspeed/ds_config.json").read_text())
    config["perseus"] = {**config["perseus"], "profile_path": None, **FAST_PROFILING,
                         "summary_path": str(directory / "summary-{rank}.json"),
                         "log_path": str(directory / "log-{rank}.jsonl"), **perseus}
    config_path = directory / "ds_config.json"
    config_path.write_text(json.dumps(config))
    return config_path


def start_example(directory: Path, perseus: dict, *args: str, nproc: int = 2) -> Launch:
    """examples/deepspeed/train.py under torchrun with `perseus` merged into its config."""
    config_path = example_config(directory, perseus)
    return start_torchrun(directory, REPO / "examples/deepspeed/train.py", "--deepspeed_config", str(config_path),
                          *args, nproc=nproc)


def summaries(tmp_path: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / f"summary-{rank}.json").read_text()) for rank in range(ranks)]


def log_phases(tmp_path: Path, rank: int) -> dict[int, str]:
    lines = (tmp_path / f"log-{rank}.jsonl").read_text().splitlines()
    return {record["iteration"]: record["phase"] for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def batch_size_jobs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The two pipeline jobs whose batch changes after deployment, launched side by side (their
    claims are about phases at known iterations and the frontier's own times)."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("batch-size")
    launches = {
        "train_batch": start_example(root / "train_batch", {}, "--iterations", "18", "--set-train-batch-size", "12", "24"),
        # Micro batch 4 -> 8 before iteration 10 of 22.
        "micro_batch": start_torchrun(root / "micro_batch", REPO / "tests/deepspeed_microbatch_worker.py",
                                      str(example_config(root / "micro_batch", {})), str(root / "micro_batch"),
                                      "10", "22"),
    }
    return {name: (launch.finish(), launch.directory) for name, launch in launches.items()}


@pytest.mark.distributed
@needs_deepspeed
def test_set_train_batch_size_replans_instead_of_falling_back(batch_size_jobs):
    completed, directory = batch_size_jobs["train_batch"]
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    for rank, summary in enumerate(summaries(directory, 2)):
        assert summary["fallback_reason"] is None
        assert summary["final_phase"] == "deployed" and len(summary["profiled_clocks"]) >= 2
        assert summary["plan_switches"][0]["iteration"] == 12  # redeployed on the new frontier
        phases = log_phases(directory, rank)
        assert phases[11] == "deployed" and phases[12] == "solving"
        assert all(phases[i] == "deployed" for i in range(13, 18))
    assert "microbatches': 6" in output  # gradient accumulation 4 -> 6


@pytest.mark.distributed
@needs_deepspeed
def test_set_train_micro_batch_size_profiles_again_instead_of_keeping_a_stale_profile(batch_size_jobs):
    """Micro batch 4 -> 8 before iteration 10 (the simulated work per computation doubles with
    it): every rank warms up, profiles and deploys again, on a frontier twice as long."""
    completed, directory = batch_size_jobs["micro_batch"]
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    for rank, summary in enumerate(summaries(directory, 2)):
        assert summary["fallback_reason"] is None and summary["final_phase"] == "deployed"
        phases = log_phases(directory, rank)
        assert phases[9] == "deployed" and phases[10] == "warmup" and phases[11] == "profiling"
        assert phases[21] == "deployed"
        result = json.loads((directory / f"rank{rank}.json").read_text())
        assert result["micro_batch_size"] == 8
        assert 1.7 < result["fastest_after_s"] / result["fastest_before_s"] < 2.3
    assert "train_micro_batch_size_per_gpu 4 -> 8" in output


PLAIN_WORKLOAD = {"simulated_workload": {"forward_seconds": 0.01, "backward_seconds": 0.02}}


@pytest.fixture(scope="module")
def plain_engine_jobs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The non-pipeline engine's jobs (observe, power limit, optimize), launched side by side."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("plain-engine")
    policy = {"type": "zeus", "mode": "power_limit",
              "power_limit": {"warmup_iters": 0, "profile_iters": 1, "step_w": 100}}
    launches = {
        "observe": start_example(root / "observe", {"mode": "observe", **PLAIN_WORKLOAD},
                                 "--stages", "0", "--iterations", "6"),
        "power_limit": start_example(root / "power_limit", {"policy": policy, **PLAIN_WORKLOAD},
                                     "--stages", "0", "--iterations", "10"),
        "optimize": start_example(root / "optimize", PLAIN_WORKLOAD, "--stages", "0", "--iterations", "2", nproc=1),
    }
    return {name: (launch.finish(), launch.directory) for name, launch in launches.items()}


@pytest.mark.distributed
@needs_deepspeed
def test_plain_engine_observe_mode_measures_every_iteration(plain_engine_jobs):
    completed, directory = plain_engine_jobs["observe"]
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    for rank, summary in enumerate(summaries(directory, 2)):
        assert summary["fallback_reason"] is None and summary["final_phase"] == "observing"
        assert summary["pipeline"] == rank  # each data-parallel rank is its own "pipeline"
        assert set(log_phases(directory, rank).values()) == {"observing"}
        assert len(log_phases(directory, rank)) == 6


@pytest.mark.distributed
@needs_deepspeed
def test_plain_engine_power_limit_mode_settles_on_a_limit(plain_engine_jobs):
    completed, directory = plain_engine_jobs["power_limit"]
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    for summary in summaries(directory, 2):
        assert summary["fallback_reason"] is None and summary["final_phase"] == "power_limit"
        assert summary["policy"]["limit_w"] is not None and len(summary["policy"]["measurements"]) >= 2


@pytest.mark.distributed
@needs_deepspeed
def test_plain_engine_optimize_mode_is_a_clear_error(plain_engine_jobs):
    completed, _ = plain_engine_jobs["optimize"]
    assert completed.returncode != 0
    assert "perseus.mode 'optimize' plans GPU clocks across pipeline stages" in completed.stderr
    assert "PipelineModule" in completed.stderr
