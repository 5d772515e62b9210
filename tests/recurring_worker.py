"""torchrun worker of the recurring-job end-to-end test: several runs of one small DeepSpeed
pipeline job in the same processes, each configured by the `"perseus"` key alone.

    torchrun --nproc_per_node 2 tests/recurring_worker.py SPEC.json

Each run builds a fresh engine through `deepspeed.initialize` (perseus-ext installed, so the
store picks the batch size), trains, hands every evaluation to `engine.perseus.report_metric`
and stops at the target, at `max_iterations`, or when perseus-ext raises PerseusEarlyStop.
The evaluation is a scripted convergence curve, `val_score = iterations / steps_to_target[B]`,
so which batch size is cheapest is a property of the job the test knows, while time and energy
are what the simulated GPUs spend. Rank r writes its runs to `<out_dir>/rank<r>.json`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

WIDTH = 16


def one_run(spec: dict) -> dict:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from perseus_ext.policies import PerseusEarlyStop

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,  # the store's batch size sets it
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 10**9,
        "perseus": spec["perseus"],
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    runtime = engine.perseus
    batch_size = engine.train_batch_size()
    samples = [(torch.randn(spec["micro_batch"], WIDTH), torch.randn(spec["micro_batch"], WIDTH))
               for _ in range(4)]
    data = iter(deepspeed.utils.RepeatingLoader(samples))
    steps_to_target = spec["steps_to_target"][str(batch_size)]
    outcome, iterations = "ended", 0
    try:
        while iterations < spec["max_iterations"]:
            engine.train_batch(data)
            iterations += 1
            if runtime.report_metric(iterations / steps_to_target):
                outcome = "reached"
                break
    except PerseusEarlyStop as stop:
        outcome = "stopped"
        stop_message = str(stop)
    else:
        stop_message = None
    schedule = runtime.schedule
    gpu = runtime.gpu
    summary = runtime.summary()
    engine.destroy()
    return {
        "batch_size": batch_size,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "engine_micro_batches": engine.micro_batches,
        "schedule_microbatches": schedule.num_microbatches,
        "frontier_plans": (summary.get("frontier") or {}).get("plans"),
        "final_phase": summary.get("final_phase"),
        # why a run was not deployed, for the test's failure message
        "fallback_reason": summary.get("fallback_reason"),
        "solve_error": getattr(runtime.solve_outcome, "error", "no solve"),
        "profiling_iterations": summary.get("profiling_iterations"),
        "phase_iterations": summary.get("phase_costs") and {
            phase: cost.get("iterations") for phase, cost in summary["phase_costs"].items()},
        "outcome": outcome,
        "iterations": iterations,
        "stop_message": stop_message,
        "run_id": runtime.job.assignment.run_id,
        "cost_limit": runtime.job.assignment.cost_limit,
        "job_energy_j": runtime.job.job_energy_j,
        "clocks_restored": gpu is None or gpu.locked_clock is None,
        "report": None if runtime.job.report is None else {
            "outcome": runtime.job.report.outcome.value, "time_s": runtime.job.report.time_s,
            "energy_j": runtime.job.report.energy_j, "cost": runtime.job.report.cost},
    }


def main(spec_path: str) -> None:
    import deepspeed
    import torch

    from perseus_ext.adapters.deepspeed import install

    install()
    spec = json.loads(Path(spec_path).read_text())
    faulthandler.dump_traceback_later(spec["timeout_s"], exit=True)  # a hang shows where it is
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    runs = [one_run(spec) for _ in range(spec["runs"])]
    rank = int(os.environ["RANK"])
    (Path(spec["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
