"""How often a two-rank job aborts at exit after the control plane's last reductions, with and
without `ControlPlane.close()` destroying its gloo groups first. Alternating runs, one table.

    python benchmarks/exit_abort.py --runs 250

Each run starts two local ranks that build a `ControlPlane`, do the close-time job summary's
reductions (`all_reduce_by`) a few times and exit, with (`close`) or without (`leave`) closing
the control plane. Without it, a gloo worker thread can still hold the last reduction's work
when the interpreter finalizes; dropping it then needs the GIL, the thread is made to exit
inside a C++ destructor, and the process aborts ("terminate called without an active
exception", exit -6). A busy machine makes it likelier: run it beside other work.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = """
import datetime, sys, time
import torch.distributed as dist
from perseus_ext.runtime.comm import ControlPlane
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2,
                        timeout=datetime.timedelta(seconds=60))
comm = ControlPlane(stage=0, timeout_s=60)
for _ in range(5):
    comm.all_reduce_by([1.0, 2.0, 3.0], "sum", time.monotonic() + 30)
if sys.argv[3] == "close":
    comm.close()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(variant: str) -> tuple[int, int]:
    """Both ranks' exit codes."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, address, str(rank), variant], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in range(2)]
    return tuple(rank.wait(timeout=120) for rank in ranks)


def main() -> None:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=bounded_int(1, 10**9), default=100, help="two-rank jobs per variant")
    args = parser.parse_args()
    aborted = {"leave": 0, "close": 0}
    failed = {"leave": 0, "close": 0}
    for _ in range(args.runs):
        for variant in aborted:
            codes = one_run(variant)
            aborted[variant] += any(code == -6 for code in codes)
            failed[variant] += any(code not in (0, -6) for code in codes)
    print(f"{'variant':<8} {'jobs':>5} {'aborted at exit (-6)':>21} {'other failures':>15}")
    for variant in aborted:
        print(f"{variant:<8} {args.runs:>5} {aborted[variant]:>21} {failed[variant]:>15}")


if __name__ == "__main__":
    main()
