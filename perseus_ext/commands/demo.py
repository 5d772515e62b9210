"""`perseus-ext demo`: the whole Perseus loop inside DeepSpeed on CPU with simulated GPUs.

It launches a real DeepSpeed pipeline job with torchrun (gloo, one process per simulated A100):
2 stages x 2 data-parallel pipelines by default. The same training runs twice from the same seed, side by side
(one iteration each in turn, so machine noise hits both alike): once with perseus-ext only
observing (default clocks: the baseline), once optimising. Midway,
one pipeline's GPUs slow down by 1.2x (a straggler) and later recover. The command prints
baseline vs perseus time and energy per iteration, splits the savings into intrinsic (fastest
plan, no straggler) and extrinsic (slower plans while another pipeline straggles), and draws
the frontier and a timeline.

The worker side (`python -m perseus_ext.commands.demo --worker SCENARIO.json`, run by torchrun)
is also what the DeepSpeed end-to-end tests drive, with other scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VARIANTS = ("disabled", "observe", "perseus", "faulty")
WIDTH = 32  # hidden size of the toy model: tiny, the simulated GPU supplies the compute time


@dataclass
class Scenario:
    """One demo/test job: topology, workload, straggler timeline and which variants to run."""

    out_dir: str
    stages: int = 2
    pipelines: int = 2
    microbatches: int = 4
    iterations: int = 64
    forward_seconds: list[float] = field(default_factory=lambda: [0.010, 0.014])
    backward_seconds: list[float] = field(default_factory=lambda: [0.020, 0.028])
    straggler_pipeline: int | None = 1
    straggler_start: int = 28
    straggler_end: int = 48
    slowdown: float = 1.2
    variants: list[str] = field(default_factory=lambda: ["observe", "perseus"])
    fault_rank: int = 1  # "faulty" variant: this rank's GPU fails every clock change
    perseus: dict[str, Any] = field(default_factory=dict)  # overrides of the perseus section

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; use {', '.join(VARIANTS)}")

    @property
    def world_size(self) -> int:
        return self.stages * self.pipelines

    def perseus_section(self, variant: str) -> dict[str, Any]:
        if variant == "disabled":
            return {"enabled": False}
        section: dict[str, Any] = {
            "enabled": True,
            "gpu": "sim:a100_sxm",
            "warmup_iterations": 2,
            "clock_stride": 6,
            "straggler_check_interval": 4,
            "log_interval": 10,
            "control_timeout_s": 120.0,
            "solver": {"min_grid_points": 300},  # a coarser grid: the toy frontier solves in ~1 s
            "simulated_workload": {
                "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds,
            },
            "frontier_path": str(Path(self.out_dir) / f"frontier-{variant}.json"),
        }
        section.update(self.perseus)
        if variant == "observe":
            section["mode"] = "observe"
        return section


# --------------------------------------------------------------------------- worker (per rank)
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
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.runtime = getattr(self.engine, "perseus", None)
        self.gpu = self.runtime.gpu if self.runtime is not None else None
        self.pipeline = self.engine.grid.get_data_parallel_rank()
        if variant == "faulty" and self.engine.global_rank == scenario.fault_rank:
            self.gpu.inject_fault("set_locked_sm_clocks", times=None)
        generator = torch.Generator().manual_seed(self.pipeline)
        batches = [(torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator))
                   for _ in range(4 * scenario.microbatches)]
        self.data = iter(deepspeed.utils.RepeatingLoader(batches))
        self.losses: list[str] = []
        self.iterations: list[dict[str, Any]] = []

    def step(self, iteration: int) -> None:
        scenario, gpu, runtime = self.scenario, self.gpu, self.runtime
        if gpu is not None and self.pipeline == scenario.straggler_pipeline:
            straggling = scenario.straggler_start <= iteration < scenario.straggler_end
            gpu.slowdown = scenario.slowdown if straggling else 1.0
        true_before = gpu.true_energy_j if gpu is not None else 0.0
        started = time.perf_counter()
        loss = self.engine.train_batch(self.data)
        record: dict[str, Any] = {"time_s": time.perf_counter() - started}
        self.losses.append(float(loss).hex())
        if runtime is not None:
            record["true_energy_j"] = gpu.true_energy_j - true_before
        self.iterations.append(record)

    def finish(self) -> dict[str, Any]:
        runtime = self.runtime
        self.engine.destroy()  # closes the runtime: clocks restored, last device records taken
        summary = runtime.summary() if runtime is not None else None
        if runtime is not None:  # what the runtime recorded from the device, per iteration
            for logged in runtime.history:
                self.iterations[logged.iteration].update(
                    energy_j=logged.energy_j, phase=logged.phase.value, plan=logged.setting.plan,
                    factor=logged.setting.factor, compute_s=logged.compute_s, coverage=logged.coverage)
        return {
            "variant": self.variant, "rank": self.engine.global_rank, "pipeline": self.pipeline,
            "stage": self.engine.stage_id, "losses": self.losses, "iterations": self.iterations,
            "summary": summary, "clocks_restored": self.gpu is None or self.gpu.locked_clock is None,
            "power_limit_w": self.gpu.power_limit_w() if self.gpu is not None else None,
            "controller_errors": runtime.controller.error_count if runtime is not None else 0,
        }


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


# --------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(scenario: Scenario, *, timeout_s: float = 600.0, quiet: bool = True) -> list[list[dict[str, Any]]]:
    """Run the scenario under torchrun; per-rank results (one entry per variant), by rank.

    A job that does not finish within `timeout_s` is killed (the whole process group), so a
    hang fails loudly instead of blocking.
    """
    out = Path(scenario.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    scenario_path = out / "scenario.json"
    scenario_path.write_text(json.dumps(dataclasses.asdict(scenario)))
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", str(scenario.world_size), "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), "-m", "perseus_ext.commands.demo", "--worker", str(scenario_path),
    ]
    log_path = out / "torchrun.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"the demo job did not finish in {timeout_s:.0f} s; see {log_path}") from None
    if code != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"the demo job failed (exit code {code}); last output:\n{tail}")
    if not quiet:
        print(log_path.read_text())
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(scenario.world_size)]


# --------------------------------------------------------------------------- analysis
def by_variant(results: list[list[dict[str, Any]]], variant: str) -> list[dict[str, Any]]:
    """Every rank's result of one variant, by rank."""
    return [next(r for r in rank_results if r["variant"] == variant) for rank_results in results]


def job_series(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Per-iteration job figure: the slowest rank's time, or the sum of every rank's energy."""
    rows = zip(*(r["iterations"] for r in ranks))
    if key == "time_s":
        return [max(item["time_s"] for item in row) for row in rows]
    return [sum(item[key] for item in row) for row in rows]


def windows(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[str, range]:
    """Iteration ranges to compare: deployed without straggler, with straggler, recovered."""
    phases = [it["phase"] for it in perseus_ranks[0]["iterations"]]
    deployed = phases.index("deployed") if "deployed" in phases else len(phases)
    if scenario.straggler_pipeline is None:
        return {"no straggler": range(deployed, scenario.iterations)}
    start = max(scenario.straggler_start, deployed)
    return {
        "no straggler": range(deployed, start),
        "straggler": range(start, scenario.straggler_end),
        "recovered": range(scenario.straggler_end, scenario.iterations),
    }


def compare(scenario: Scenario, results: list[list[dict[str, Any]]], baseline: str = "observe") -> dict[str, Any]:
    """Baseline vs perseus per window of iterations.

    Time: median job time per iteration (a shared 2-core machine adds scheduling spikes that
    are not the method's doing). Energy: mean job energy per iteration, both the simulator's
    exact integral (`true_energy_j`, the table's figure) and what the runtime measured with the
    coarse NVML-like counter (`energy_j`; per-iteration readings are quantised to counter
    updates, so only means over many iterations are meaningful).
    """
    base, pers = by_variant(results, baseline), by_variant(results, "perseus")
    series = {
        name: {key: job_series(ranks, key) for key in ("time_s", "energy_j", "true_energy_j")}
        for name, ranks in (("baseline", base), ("perseus", pers))
    }
    table = {}
    for label, span in windows(scenario, pers).items():
        if len(span) == 0:
            continue
        row: dict[str, Any] = {}
        for name in ("baseline", "perseus"):
            row[f"{name}_time_s"] = statistics.median(series[name]["time_s"][i] for i in span)
            for key in ("energy_j", "true_energy_j"):
                row[f"{name}_{key}"] = statistics.fmean(series[name][key][i] for i in span)
        row["time_change"] = row["perseus_time_s"] / row["baseline_time_s"] - 1.0
        row["energy_saving"] = 1.0 - row["perseus_true_energy_j"] / row["baseline_true_energy_j"]
        row["measured_energy_saving"] = 1.0 - row["perseus_energy_j"] / row["baseline_energy_j"]
        row["iterations"] = [span.start, span.stop]
        table[label] = row
    return {"windows": table, "series": series}


def straggler_response(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Plan switches of each pipeline (from its stage-0 rank), for the timeline and tests."""
    return {r["pipeline"]: r["summary"]["plan_switches"] for r in perseus_ranks if r["stage"] == 0}


def print_report(scenario: Scenario, comparison: dict[str, Any], results: list[list[dict[str, Any]]]) -> None:
    pers = by_variant(results, "perseus")
    summary0 = pers[0]["summary"]
    print()
    print(f"perseus-ext demo: DeepSpeed {scenario.stages} stages x {scenario.pipelines} pipelines, "
          f"{scenario.microbatches} microbatches, simulated A100 SXM, {scenario.iterations} iterations")
    print(f"profiling: {summary0['profiling_iterations']} iterations, clocks {summary0['profiled_clocks']}")
    frontier = summary0.get("frontier")
    if frontier:
        print(f"frontier (pipeline 0): {frontier['plans']} plans; fastest plan {frontier['fastest']['time_s']:.4f} s "
              f"{frontier['fastest']['energy_j']:.1f} J vs all-max-clock {frontier['all_max_clock']['energy_j']:.1f} J "
              f"(model: {100 * frontier['intrinsic_saving']:.1f}% intrinsic bloat)")
    print()
    print("per iteration over each window: median job time (slowest rank), mean job energy (all GPUs)")
    header = (f"{'window':<14}{'iters':>9}{'time/it base':>14}{'perseus':>10}{'change':>9}"
              f"{'energy/it base':>16}{'perseus':>10}{'saved':>8}{'(counter)':>11}")
    print(header)
    print("-" * len(header))
    for label, row in comparison["windows"].items():
        span = f"{row['iterations'][0]}-{row['iterations'][1] - 1}"
        print(f"{label:<14}{span:>9}{row['baseline_time_s']:>12.4f} s{row['perseus_time_s']:>8.4f} s"
              f"{100 * row['time_change']:>+8.1f}%{row['baseline_true_energy_j']:>14.1f} J"
              f"{row['perseus_true_energy_j']:>8.1f} J{100 * row['energy_saving']:>7.1f}%"
              f"{100 * row['measured_energy_saving']:>10.1f}%")
    print("energy: the simulated GPUs' exact energy; (counter): the saving perseus-ext measured "
          "itself with the coarse NVML-like energy counter")
    table = comparison["windows"]
    if "no straggler" in table:
        calm = table["no straggler"]
        intrinsic = calm["baseline_true_energy_j"] - calm["perseus_true_energy_j"]
        print()
        print(f"intrinsic savings (fastest plan, no slowdown): {intrinsic:.1f} J/iteration "
              f"({100 * calm['energy_saving']:.1f}%)")
        if "straggler" in table:
            slow = table["straggler"]
            total = slow["baseline_true_energy_j"] - slow["perseus_true_energy_j"]
            print(f"extrinsic savings (non-stragglers slowed to the straggler): {total - intrinsic:.1f} "
                  f"J/iteration on top ({100 * (total - intrinsic) / slow['baseline_true_energy_j']:.1f}%), "
                  f"{100 * slow['energy_saving']:.1f}% in total")
    coverage = [r["summary"]["clock_coverage"] for r in pers if r["summary"]]
    exact = [c["exact"] for c in coverage if c["exact"] is not None]
    estimated = [c["estimated"] for c in coverage if c["estimated"] is not None]
    if exact:
        print(f"clock coverage: {100 * statistics.fmean(exact):.1f}% (share of deployed compute time at its "
              f"planned clock, exact on the simulated devices; estimated from device markers as on a real "
              f"GPU: {100 * statistics.fmean(estimated) if estimated else float('nan'):.1f}%; clock-change "
              f"latency {1000 * coverage[0]['switch_latency_s']:.0f} ms)")
    for pipeline, switches in sorted(straggler_response(scenario, pers).items()):
        steps = ", ".join(f"it {s['iteration']}: plan {s['plan']} (x{s['factor']:.2f})" for s in switches)
        print(f"pipeline {pipeline} plans: {steps}")


def plot(scenario: Scenario, comparison: dict[str, Any], results: list[list[dict[str, Any]]]) -> list[Path]:
    """frontier.png (time-energy frontier with the plans used) and timeline.png (time and
    energy of every iteration, baseline vs perseus)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from perseus_ext.planning.frontier import Frontier
    from perseus_ext.plotting import plot_frontier

    out = Path(scenario.out_dir)
    paths = []
    frontier_file = out / "frontier-perseus.json"
    if frontier_file.is_file():
        frontier = Frontier.load(frontier_file)
        used = {s["plan"] for s in straggler_response(scenario, by_variant(results, "perseus"))[0]}
        marks = {f"plan {index} (straggler)": frontier.plans[index] for index in sorted(used - {0})}
        plot_frontier(frontier, out / "frontier.png", marks=marks, title="Pipeline 0 time-energy frontier")
        paths.append(out / "frontier.png")
    series = comparison["series"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, style in (("baseline", "k-"), ("perseus", "g-")):
        top.plot(series[name]["time_s"], style, label=name, linewidth=1)
        bottom.plot(series[name]["true_energy_j"], style, label=name, linewidth=1)
    for axis in (top, bottom):
        if scenario.straggler_pipeline is not None:
            axis.axvspan(scenario.straggler_start, scenario.straggler_end, color="orange", alpha=0.2)
    top.set_ylabel("time/iteration (s)")
    bottom.set_ylabel("job energy/iteration (J)")
    bottom.set_xlabel("iteration (orange: straggler)")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=120)
    plt.close(fig)
    paths.append(out / "timeline.png")
    return paths


# --------------------------------------------------------------------------- CLI
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the Perseus loop inside DeepSpeed on CPU with simulated GPUs",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", default="perseus-demo", help="output folder (default: %(default)s)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default: %(default)s)")
    parser.add_argument("--pipelines", type=int, default=2,
                        help="data-parallel pipelines; pipeline 1 straggles midway (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=64, help="training iterations per run (default: %(default)s)")
    parser.add_argument("--slowdown", type=float, default=1.2, help="straggler slowdown factor (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is killed")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from perseus_ext.errors import ConfigError

    if args.stages < 2 or args.pipelines < 1 or args.microbatches < 1:
        raise ConfigError("--stages must be >= 2, --pipelines and --microbatches >= 1")
    if args.iterations < 40:
        raise ConfigError("--iterations must be >= 40 to leave room for profiling and a straggler")
    forward = [0.010 + 0.004 * s / (args.stages - 1) for s in range(args.stages)]
    scenario = Scenario(
        out_dir=args.out, stages=args.stages, pipelines=args.pipelines,
        microbatches=args.microbatches, iterations=args.iterations,
        forward_seconds=forward, backward_seconds=[2 * f for f in forward],
        straggler_pipeline=1 if args.pipelines > 1 else None,
        straggler_start=int(args.iterations * 0.45), straggler_end=int(args.iterations * 0.75),
        slowdown=args.slowdown,
    )
    started = time.perf_counter()
    print(f"launching {scenario.world_size} DeepSpeed ranks (torchrun, gloo); log: {Path(args.out) / 'torchrun.log'}")
    results = launch(scenario, timeout_s=args.timeout)
    comparison = compare(scenario, results)
    print_report(scenario, comparison, results)
    paths = plot(scenario, comparison, results)
    (Path(args.out) / "comparison.json").write_text(json.dumps(comparison["windows"], indent=2))
    print(f"\nplots: {', '.join(str(p) for p in paths)}; finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torchrun worker of perseus-ext demo")
    parser.add_argument("--worker", required=True, metavar="SCENARIO_JSON")
    worker_main(parser.parse_args().worker)
