"""Run DeepSpeedExamples' pipeline-parallelism script (AlexNet, 2 stages) as a new user would,
with `"perseus": {"enabled": true}` on simulated A100s, on this CPU-only machine.

    python benchmarks/deepspeed_examples_pipeline.py --example DIR [--gas 4] [--steps 30] [--perseus '{...}']

DIR is a checkout's `training/pipeline_parallelism` (nothing is fetched; without it the script
exits with a reason). The example's `train.py` runs unmodified; only what a CPU-only machine
without network or torchvision requires is shimmed, in each rank before the script starts:
`torchvision` (not installed) is a stand-in whose `models.AlexNet` is the example's own
`alexnet.py` (the same network) and whose `datasets.CIFAR10` is random 224x224 images (no
download), `torch.cuda.set_device` is a no-op, and the backend is gloo (`--backend gloo`).
Prints each rank's perseus-ext summary: profiled clocks, stop reason, profiling iterations,
framework overhead and the frontier's modelled saving.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHIM = r'''
import os, runpy, sys, types
import torch
example = os.environ["DSE_PIPELINE_DIR"]
sys.path.insert(0, example)
from alexnet import AlexNet
class CIFAR10(torch.utils.data.Dataset):
    """Random 224x224 images with CIFAR-10 labels: no download, no torchvision."""
    def __init__(self, root, train=True, download=False, transform=None):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(64, 3, 224, 224, generator=generator)
        self.labels = torch.randint(0, 10, (64,), generator=generator)
    def __len__(self):
        return 10**6
    def __getitem__(self, index):
        return self.images[index % 64], self.labels[index % 64]
class _Identity:
    def __init__(self, *args, **kwargs):
        pass
    def __call__(self, x):
        return x
vision = types.ModuleType("torchvision")
vision.models = types.SimpleNamespace(AlexNet=AlexNet, vgg19=None)
vision.datasets = types.SimpleNamespace(CIFAR10=CIFAR10)
vision.transforms = types.SimpleNamespace(Compose=_Identity, Resize=_Identity, CenterCrop=_Identity,
                                          ToTensor=_Identity, Normalize=_Identity)
sys.modules.update({"torchvision": vision, "torchvision.models": vision.models,
                    "torchvision.datasets": vision.datasets, "torchvision.transforms": vision.transforms})
torch.cuda.set_device = lambda device: None
from perseus_ext.adapters.deepspeed import install
install()
sys.argv = [os.path.join(example, "train.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def print_summaries(out: Path) -> None:
    """Each rank's profiling figures, then the model check: the fastest plan's modelled energy
    against the deployed iterations' energy (the counter's, summed over the ranks), and both
    against the warmup iterations at default clocks."""
    summaries = [json.loads((out / f"summary-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, summary in enumerate(summaries):
        frontier = summary.get("frontier") or {}
        print(json.dumps({"rank": rank, "profiling_iterations": summary.get("profiling_iterations"),
                          "profiled_clocks": summary.get("profiled_clocks"),
                          "overhead_ms": round(1000 * summary.get("profile_overhead_s", 0.0), 2),
                          "frontier": {k: frontier.get(k) for k in ("intrinsic_saving", "fastest", "all_max_clock")
                                       if k in frontier}}))
    frontier = summaries[0].get("frontier") or {}
    deployed = [s.get("deployed_intrinsic") or {} for s in summaries]
    warmup = [((s.get("phase_costs") or {}).get("warmup") or {}).get("energy_per_iteration_j") for s in summaries]
    if "fastest" in frontier and all(d.get("energy_j") for d in deployed) and all(warmup):
        planned, measured, default = frontier["fastest"]["energy_j"], sum(d["energy_j"] for d in deployed), sum(warmup)
        print(f"model check (fastest plan, {deployed[0]['iterations']} deployed iterations): energy {planned:.1f} J "
              f"planned vs {measured:.1f} J measured ({100 * (planned / measured - 1):+.1f}%); warmup at default "
              f"clocks {default:.1f} J/iteration: saving {100 * (1 - measured / default):.1f}% measured, "
              f"{100 * frontier.get('intrinsic_saving', 0.0):.1f}% modelled")


def main() -> int:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--example", default=os.environ.get("DSE_PIPELINE_DIR"),
                        help="DeepSpeedExamples' training/pipeline_parallelism directory")
    parser.add_argument("--gas", type=bounded_int(1, 10**9), default=4, help="microbatches per iteration")
    parser.add_argument("--steps", type=bounded_int(1, 10**9), default=30)
    parser.add_argument("--forward-seconds", type=bounded_float(0.0, 1e9, inclusive_min=False), nargs=2, default=[0.05, 0.05])
    parser.add_argument("--backward-seconds", type=bounded_float(0.0, 1e9, inclusive_min=False), nargs=2, default=[0.10, 0.10])
    parser.add_argument("--perseus", default="{}", help="extra keys of the perseus section (JSON)")
    parser.add_argument("--out", default=None, help="directory for the config, logs and summaries")
    parser.add_argument("--timeout", type=bounded_float(0.0, 1e9, inclusive_min=False), default=1200)
    parser.add_argument("--package-root", default=str(REPO), help="the perseus-ext checkout to run (compare versions)")
    args = parser.parse_args()
    example = Path(args.example) if args.example else None
    if example is None or not (example / "train.py").is_file() or not (example / "alexnet.py").is_file():
        print(f"skipped: no DeepSpeedExamples pipeline_parallelism checkout at {example} (pass --example "
              f"or set DSE_PIPELINE_DIR to its training/pipeline_parallelism directory)")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="dse-pipeline-"))
    out.mkdir(parents=True, exist_ok=True)
    perseus = {"enabled": True,
               "simulated_workload": {"forward_seconds": args.forward_seconds,
                                      "backward_seconds": args.backward_seconds},
               "summary_path": str(out / "summary-{rank}.json"), "log_interval": 0,
               **json.loads(args.perseus)}
    config = {"train_batch_size": 2 * args.gas, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "steps_per_print": 10**6,
              "perseus": perseus}
    (out / "ds_config.json").write_text(json.dumps(config, indent=1))
    (out / "shim.py").write_text(SHIM)
    env = dict(os.environ, OMP_NUM_THREADS="1", PERSEUS_GPU="sim:a100_sxm", DSE_PIPELINE_DIR=str(example),
               PYTHONPATH=os.pathsep.join(filter(None, [args.package_root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", "29631", str(out / "shim.py"), "--deepspeed_config",
               str(out / "ds_config.json"), "-p", "2", "--steps", str(args.steps), "--backend", "gloo"]
    with open(out / "torchrun.log", "w") as log:
        finished = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if finished.returncode:
        print(f"the job failed (exit {finished.returncode}); see {out / 'torchrun.log'}")
        return finished.returncode
    print_summaries(out)
    print(f"logs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
