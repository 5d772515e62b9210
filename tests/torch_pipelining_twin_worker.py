"""One torchrun rank of a side-by-side comparison on a torch.distributed.pipelining schedule.

Two copies of the example's model and schedule (examples/torch_pipelining/train.py's `build`,
imported, not copied) train side by side in this process, one step each in turn: one with
perseus-ext optimizing (baseline probes on), its twin with perseus-ext in observe mode (default
clocks, the same simulated workload). Each copy has its own pipeline group and its own simulated
GPU, so they share nothing but the process and the machine's noise. Each rank writes
DIR/rank-N.json: per variant the simulated GPU's exact energy of every step (read around the
step, as perseus-ext's DeepSpeed demo does), the runtime's own iteration samples (what its
measured saving is computed from), its summary, and whether the clocks were restored.

    --config FILE / --config-observe FILE   the two variants' "perseus" sections

`twin_figures(DIR)` reads a finished job back: the job's measured saving with its interval (what
perseus-ext reports against its baseline probes) and the side-by-side saving (exact energy of
the same deployed iterations, perseus against its twin).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_pipelining" / "train.py"
VARIANTS = ("perseus", "observe")
SCHEDULE_CLASSES = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                    "ScheduleDualPipeV")
MICROBATCHES = 4
ITERATIONS = 44  # first step + warm-up + profiling (up to 8) + solve: ~30 deployed, ~9 of them probes
# A short job: four candidate clocks, an inline solve, a probe in every four deployed iterations,
# and an energy counter that updates every 10 ms (a 100 ms counter would need many more probes
# than a test can run for an interval this narrow against ~0.1-0.2 s iterations).
PERSEUS = {
    "enabled": True, "gpu": "sim:a100_sxm?period=0.01", "warmup_iterations": 1,
    "candidate_clocks": [1410, 1200, 990, 780], "solve_in_background": False, "straggler_check_interval": 3,
    "log_interval": 100, "baseline_fraction": 0.25,
    # Computations of 4-12 ms: the default clock-change budget (5 a second) would leave one clock
    # per stage, so this toy job plans without one, as a full-size job does anyway.
    "solver": {"max_clock_changes_per_s": 0},
    "simulated_workload": {"forward_seconds": [0.004, 0.006], "backward_seconds": [0.008, 0.012]},
}


def write_configs(directory: Path) -> tuple[Path, Path]:
    """The two variants' config files in `directory`: (perseus, observe)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "perseus.json", directory / "observe.json"
    for path, section in zip(paths, (PERSEUS, {**PERSEUS, "mode": "observe"})):
        path.write_text(json.dumps({"perseus": section}), encoding="utf-8")
    return paths


def command(directory: Path, schedule_class: str, port: int) -> list[str]:
    """The torchrun command of one side-by-side job on two ranks, results in `directory`/result."""
    perseus, observe = write_configs(directory)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(Path(__file__).resolve()), "--config", str(perseus), "--config-observe", str(observe),
            "--schedule", schedule_class, "--microbatches", str(MICROBATCHES), "--iterations", str(ITERATIONS),
            "--result", str(directory / "result")]


def _example():
    spec = importlib.util.spec_from_file_location("torch_pipelining_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


class VariantRun:
    """One copy of the job on this rank: its schedule, optimizer, perseus-ext handle and the
    exact energy of each step on its own simulated GPU."""

    def __init__(self, example: Any, args: argparse.Namespace, variant: str, config: Path) -> None:
        import torch
        import torch.distributed as dist

        from perseus_ext.torch_pipelining import enable

        world = dist.get_world_size()
        self.rank = dist.get_rank()
        group = dist.new_group(list(range(world)))  # this variant's own pipeline group
        self.modules, self.schedule = example.build(args, group, self.rank, world)
        self.perseus = enable(self.schedule, config)
        self.variant = variant
        parameters = [p for m in self.modules for p in m.parameters()]
        self.parameters = parameters
        self.optimizer = torch.optim.SGD(parameters, lr=0.01)
        generator = torch.Generator().manual_seed(0)
        batch = args.microbatches * 2
        self.data = [(torch.randn(batch, example.WIDTH, generator=generator),
                      torch.randn(batch, example.WIDTH, generator=generator)) for _ in range(4)]
        indices = example.stage_indices(args.schedule, self.rank, world, args.chunks)
        slices = example.slices_of(args.schedule, world, args.chunks)
        self.is_first, self.is_last = 0 in indices, max(indices) == slices - 1
        # Exact energy of the steps the runtime recorded, in its iteration order.
        self.step_energies: list[float] = []

    def step(self, iteration: int) -> None:
        inputs, targets = self.data[iteration % len(self.data)]
        self.optimizer.zero_grad()
        runtime = self.perseus.runtime
        before = self._settled_energy(runtime)
        self.schedule.step(*((inputs,) if self.is_first else ()), target=targets if self.is_last else None,
                           losses=[] if self.is_last else None)
        self.optimizer.step()
        if before is not None:
            self.step_energies.append(self._settled_energy(runtime) - before)

    @staticmethod
    def _settled_energy(runtime: Any) -> float | None:
        """The exact energy so far once the device has done every step launched and every rank
        is here: each variant's step then starts together on all ranks and its energy reading holds
        all of its work and none of the other variant's turn."""
        import torch.distributed as dist

        dist.barrier()
        if runtime is None:
            return None
        runtime.gpu.device.synchronize()
        return runtime.gpu.true_energy_j

    def finish(self) -> dict[str, Any]:
        from perseus_ext.observability.run_figures import Sample

        runtime = self.perseus.runtime
        gpu = runtime.gpu if runtime is not None else None
        summary = self.perseus.close()  # restores clocks; the job's figures gathered over the ranks
        samples = [dataclasses.asdict(Sample.of_record(r)) for r in runtime.history] if runtime else []
        return {
            "variant": self.variant, "rank": self.rank, "summary": summary, "samples": samples,
            "step_energies": self.step_energies,
            "clocks_restored": gpu is None or gpu.locked_clock is None,
        }


@dataclasses.dataclass(frozen=True)
class TwinFigures:
    """One side-by-side job's figures: the measured saving over the job (every rank's energy,
    the slowest rank's time) against its baseline probes, with its interval at `confidence`,
    and the side-by-side saving on the simulator's exact energy over the same deployed
    iterations (probes left out: they run default clocks on purpose)."""

    schedule_class: str
    deployed: int
    probes: int
    saving: float
    saving_low: float | None
    saving_high: float | None
    side_by_side: float
    intrinsic: float | None  # the model's: the fastest plan against all GPUs at max clock
    confidence: float

    @property
    def agrees(self) -> bool:
        return self.saving_low is not None and self.saving_low <= self.side_by_side <= self.saving_high


def twin_figures(directory: Path, confidence: float = 0.95) -> TwinFigures:
    """The figures of the job whose ranks wrote `directory`/rank-N.json."""
    import statistics

    from perseus_ext.observability.run_figures import DEPLOYED, PROBE, Sample, job_samples, measured_counterfactual

    ranks = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(directory.glob("rank-*.json"))]
    if not ranks:
        raise FileNotFoundError(f"no rank-N.json in {directory}")
    runs = {variant: [next(r for r in rank if r["variant"] == variant) for rank in ranks] for variant in VARIANTS}
    samples = job_samples([[Sample(**s) for s in run["samples"]] for run in runs["perseus"]])
    plans = [s.iteration for s in samples if s.label == DEPLOYED]
    measured = measured_counterfactual(samples, confidence)["all"]
    if not plans or measured is None:
        raise ValueError(f"{directory}: the job ran {len(plans)} deployed iterations and no measured saving")

    def energy(variant: str, iteration: int) -> float:
        return sum(run["step_energies"][iteration] for run in runs[variant])

    side_by_side = 1.0 - statistics.fmean(energy("perseus", i) for i in plans) / statistics.fmean(
        energy("observe", i) for i in plans)
    model = runs["perseus"][0]["summary"].get("model") or {}
    low, high = measured["saving_low"], measured["saving_high"]
    return TwinFigures(runs["perseus"][0]["summary"]["torch_pipelining"]["schedule_class"], len(plans),
                       sum(s.label == PROBE for s in samples), float(measured["saving"]),
                       None if low is None else float(low), None if high is None else float(high),
                       side_by_side, model.get("intrinsic_saving"), confidence)


def main() -> None:
    example = _example()
    parser = example.parser()
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--config-observe", type=Path, required=True)
    args = parser.parse_args()
    args.result.mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    configs = {"perseus": Path(args.config), "observe": args.config_observe}
    runs = [VariantRun(example, args, variant, configs[variant]) for variant in VARIANTS]
    for iteration in range(args.iterations):
        for run in runs:
            run.step(iteration)
    results = [run.finish() for run in runs]
    rank = dist.get_rank()
    (args.result / f"rank-{rank}.json").write_text(json.dumps(results, default=str), encoding="utf-8")
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # everything is closed; skip the interpreter's slow torch teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
