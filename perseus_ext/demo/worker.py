"""One torchrun rank of a comparison job: every variant's DeepSpeed engine trains side by side,
one iteration each in turn, and the rank writes what each variant measured.

Run by `perseus_ext.demo.launch` as `python -m perseus_ext.demo.worker --worker SCENARIO.json`.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from perseus_ext.demo.scenario import WIDTH, Scenario


class _VariantRun:
    """One variant's engine on this rank. All variants of a job train side by side, one
    iteration each in turn, so a noisy machine slows every variant alike and comparisons stay
    fair; they share nothing but the process."""

    def __init__(self, scenario: Scenario, variant: str) -> None:
        import deepspeed
        import torch
        from deepspeed.pipe import PipelineModule

        self.scenario, self.variant = scenario, variant
        torch.manual_seed(1234)
        layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                  for _ in range(2 * scenario.stages)]
        model = PipelineModule(layers=layers, num_stages=scenario.stages, loss_fn=torch.nn.MSELoss())
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": scenario.microbatches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "steps_per_print": 10**9,
            "perseus": scenario.perseus_section(variant),
            **scenario.deepspeed,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.runtime = getattr(self.engine, "perseus", None)
        self.gpu = _simulated(self.runtime.gpu) if self.runtime is not None else None
        if variant == "t-star":  # before deployment, which takes the runtime's policy
            from perseus_ext.policies.base import StragglerPolicy

            self.runtime.policy = StragglerPolicy(wait_aware=False)
        self.pipeline = self.engine.grid.get_data_parallel_rank()
        if variant == "faulty" and self.engine.global_rank == scenario.fault_rank:
            self.gpu.inject_fault("set_locked_sm_clocks", times=None)
        generator = torch.Generator().manual_seed(self.pipeline)
        batches = [(torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator))
                   for _ in range(4 * scenario.microbatches)]
        self.data = iter(deepspeed.utils.RepeatingLoader(batches))
        self.losses: list[str] = []
        self.iterations: list[dict[str, Any]] = []
        self._mark: tuple[float, float] | None = None  # (wall time, exact energy) at the last step's start
        self._spans: collections.deque[tuple[int, Any, Any]] = collections.deque()  # (iteration, markers around its step) not yet read

    def step(self, iteration: int) -> None:
        scenario, gpu = self.scenario, self.gpu
        if gpu is not None and self.pipeline == scenario.straggler_pipeline:
            straggling = scenario.straggler_start <= iteration < scenario.straggler_end
            gpu.slowdown = scenario.slowdown if straggling else 1.0
        self._close_previous()
        first = gpu.device.record_marker() if gpu is not None else None
        started = time.perf_counter()
        loss = self.engine.train_batch(self.data)
        self.iterations.append({"time_s": time.perf_counter() - started})
        self.losses.append(float(loss).hex())
        if gpu is not None:
            self._spans.append((iteration, first, gpu.device.record_marker()))

    def _close_previous(self) -> None:
        """The previous step's exact energy and period from its start to this one's
        (`tiled_energy_j`, `period_s`): step starts tile the device's time, every joule counted
        once, idle turns included, which the model check takes out at the blocking power. And
        every step the device has ended, read without waiting for it (`_read_spans`)."""
        if self.gpu is None:
            return
        self._read_spans()
        now, energy = time.perf_counter(), self.gpu.true_energy_j
        if self._mark is not None and self.iterations:
            self.iterations[-1].update(tiled_energy_j=energy - self._mark[1], period_s=now - self._mark[0])
        self._mark = (now, energy)

    def _read_spans(self) -> None:
        """Each step on this device: from its start marker (reached once the device is done with
        earlier work) to its end marker (its last work done), `device_start_s` and
        `device_end_s`, and the exact energy drawn in between, `true_energy_j`.

        The side-by-side tables compare the job's steps on the devices (`analysis.job_series`),
        not the host's time around `train_batch`: the host runs a few computations ahead of its
        device and returns from a step before the device ends it, so its wall time is not the
        iteration's, and the energy read around it misses the step's last work -- by more for
        the variant whose host is held longer (the one that changes clocks). Read only once the
        device has ended a step, so that measuring never holds the host back."""
        device = self.gpu.device
        while self._spans and self._spans[0][2].query():
            iteration, first, last = self._spans.popleft()
            start_s, end_s = first.device_time_s(), last.device_time_s()
            self.iterations[iteration].update(device_start_s=start_s, device_end_s=end_s,
                                              true_energy_j=device.exact_energy_j(start_s, end_s))

    def finish(self) -> dict[str, Any]:
        runtime = self.runtime
        if self.gpu is not None:
            self.gpu.device.synchronize()  # every step's work done: its energy is all in, its span is read next
        self._close_previous()
        self.engine.destroy()  # closes the runtime: clocks restored, last device records taken
        summary = runtime.summary() if runtime is not None else None
        if runtime is not None:  # what the runtime recorded from the device, per iteration
            for logged in runtime.history:
                self.iterations[logged.iteration].update(
                    energy_j=logged.energy_j, phase=logged.phase.value, plan=logged.setting.plan,
                    factor=logged.setting.factor, compute_s=logged.compute_s, coverage=logged.coverage,
                    first_computation_s=logged.first_computation_s,
                    probe=logged.setting.probe)
        return {
            "variant": self.variant, "rank": self.engine.global_rank, "pipeline": self.pipeline,
            "stage": self.engine.stage_id, "losses": self.losses, "iterations": self.iterations,
            "summary": summary, "clocks_restored": self.gpu is None or self.gpu.locked_clock is None,
            "power_limit_w": self.gpu.power_limit_w() if self.gpu is not None else None,
            "controller_errors": runtime.controller.error_count if runtime is not None else 0,
            "idle_power_w": self.gpu.preset.idle_power_w if self.gpu is not None else None,
        }


def _simulated(gpu: Any) -> Any:
    """The simulated GPU the worker slows down and reads exact energy from: behind zeusd (a job
    that may not set clocks itself), the one the daemon's writes reach."""
    from perseus_ext.measurement.gpu.zeusd import ZeusdGPU

    return gpu.reader if isinstance(gpu, ZeusdGPU) else gpu


def worker_main(scenario_path: str) -> None:
    """Entry point of one torchrun rank: train every variant side by side, write the results."""
    import deepspeed
    import torch

    from perseus_ext.adapters.deepspeed import install

    install()
    scenario = Scenario(**json.loads(Path(scenario_path).read_text()))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    runs = [_VariantRun(scenario, variant) for variant in scenario.variants]
    for iteration in range(scenario.iterations):
        for run in runs:
            run.step(iteration)
    results = [run.finish() for run in runs]
    rank = int(os.environ["RANK"])
    (Path(scenario.out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    # torch's documented shutdown: a gloo group left to interpreter exit can abort the process.
    torch.distributed.destroy_process_group()
    # Everything is written and closed (the runtimes closed in finish(), atexit handlers run
    # now): skip the interpreter's finalization of torch and DeepSpeed, ~1 s of CPU per rank,
    # which four ranks on two cores pay in series at the end of every comparison job.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torchrun worker of a perseus-ext comparison job")
    parser.add_argument("--worker", required=True, metavar="SCENARIO_JSON")
    worker_main(parser.parse_args().worker)
