"""Measured saving against a side-by-side twin, per torch.distributed.pipelining schedule class.

    python benchmarks/torch_pipelining_saving.py --output-dir out/torch-twins

For every supported schedule class one torchrun job (2 ranks, gloo, simulated A100s) trains the
example's model twice side by side, one step each in turn (tests/torch_pipelining_twin_worker.py,
the job tests/test_torch_pipelining_twin.py checks): perseus-ext optimizing with baseline probes,
and its twin in observe mode at default clocks. The table gives the saving the job measured
against its own probes with its 95 % interval (what `perseus-ext report` says of a real job), the
side-by-side saving on the simulator's exact energy over the same deployed iterations, and the
model's intrinsic saving (the deployed fastest plan against all GPUs at max clock). The jobs run
one after another (`--parallel` runs several at once, as the test does, with more host noise).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

from perseus_ext.commands.arguments import bounded_int

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "torch_pipelining_twin_worker.py"
LAUNCH_TIMEOUT_S = 600


def _worker():
    spec = importlib.util.spec_from_file_location("torch_pipelining_twin_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    worker = _worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output-dir", type=Path, default=Path("out/torch-twins"), help="where the jobs write")
    parser.add_argument("--classes", nargs="+", choices=worker.SCHEDULE_CLASSES, default=list(worker.SCHEDULE_CLASSES))
    parser.add_argument("--parallel", type=bounded_int(1, 8), default=1, help="jobs at once")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    pending = list(args.classes)
    running: dict[str, subprocess.Popen] = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            directory = args.output_dir / name
            running[name] = subprocess.Popen(worker.command(directory, name, _free_port()), cwd=directory, env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        name = next(iter(running))
        _, stderr = running.pop(name).communicate(timeout=LAUNCH_TIMEOUT_S)
        if not any((args.output_dir / name / "result").glob("rank-*.json")):
            sys.exit(f"the {name} job wrote no results:\n{stderr[-3000:]}")
    print(f"2 ranks x {worker.MICROBATCHES} microbatches, {worker.ITERATIONS} steps each side, simulated A100 "
          f"(energy counter every 10 ms); saving = 1 - perseus / default-clock energy per iteration\n")
    print("| schedule class | deployed iterations | probes | measured saving [95 % CI] | side-by-side twin "
          "| twin inside | model intrinsic |")
    print("|---|---:|---:|---|---:|---|---:|")
    for name in args.classes:
        f = worker.twin_figures(args.output_dir / name / "result")
        interval = "no interval" if f.saving_low is None else f"[{100 * f.saving_low:.1f}, {100 * f.saving_high:.1f}]"
        intrinsic = "-" if f.intrinsic is None else f"{100 * f.intrinsic:.1f} %"
        print(f"| `{name}` | {f.deployed} | {f.probes} | {100 * f.saving:.1f} % {interval} | {100 * f.side_by_side:.1f} % "
              f"| {'yes' if f.agrees else 'no'} | {intrinsic} |")


if __name__ == "__main__":
    main()
