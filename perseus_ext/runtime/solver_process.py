"""Solving the frontier in a child process, so training keeps its CPU and its GIL meanwhile.

Why a fresh interpreter (`python -m perseus_ext.runtime.solver_process`) rather than a thread or
`multiprocessing`: a solver thread competes for the GIL with the training loop's Python (in
tests it slowed training iterations by half while solving), and `multiprocessing`'s spawn and
forkserver modes re-import the training script's `__main__`, which would start a second training
run in scripts without a main guard.

The child lowers its priority, reads a pickled `SolveProblem` on stdin and writes a pickled
`SolveResult` to stdout, which the parent drains without blocking once per iteration: no
temporary file can be left behind. On Linux the child asks the kernel to kill it when its
parent dies (PR_SET_PDEATHSIG), so a dead leader never leaves a solver running.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from perseus_ext.allocator import keep_freed_memory
from perseus_ext.runtime.records import SolveProblem, SolveResult

NICENESS = 10
READ_CHUNK_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1

logger = logging.getLogger(__name__)


def solve(problem: SolveProblem, *, in_background: bool = False) -> SolveResult:
    """The frontier with its wait-aware extension and without clock changes that save less than
    `problem.switch_cost_j`, or the error that prevented the frontier; never raises."""
    started = time.perf_counter()
    try:
        from perseus_ext.planning.solver import solve_frontier

        measured = problem.measured
        profile = measured.for_schedule(problem.schedule)  # one entry per virtual stage
        if problem.stage_constant:  # no clock changes inside an iteration: nothing to thin
            from perseus_ext.planning.stage_constant import solve_stage_constant

            frontier = solve_stage_constant(problem.schedule, profile, measured.blocking_power_per_stage_w,
                                            problem.switch_latency_s, wait_aware=True)
            return SolveResult(frontier, None, time.perf_counter() - started, in_background, measured)
        if problem.options is not None and problem.options.power_swing_cap > 0:  # clocks and fillers, not thinned
            from perseus_ext.planning.filler_program import solve_capped

            frontier, capped = solve_capped(problem.schedule, profile, measured.blocking_power_per_stage_w,
                                            problem.options, problem.switch_latency_s, power_floor=problem.power_floor)
            return SolveResult(frontier, None, time.perf_counter() - started, in_background, measured, capped)
        frontier = solve_frontier(
            problem.schedule, profile, measured.blocking_power_per_stage_w,
            problem.options, switch_latency_s=problem.switch_latency_s, wait_aware=True,
        )
    except Exception as err:  # reported to every rank of the pipeline instead
        return SolveResult(None, f"{type(err).__name__}: {err}", time.perf_counter() - started, in_background)
    try:
        from perseus_ext.planning.thinning import with_fewer_switches

        frontier = with_fewer_switches(
            frontier, problem.schedule, profile, measured.blocking_power_per_stage_w,
            problem.switch_latency_s, problem.switch_cost_j,
        )
    except Exception:  # the frontier as solved is still exact, only with more clock changes
        logger.exception("perseus-ext: merging clock changes that save less than %.3g J failed",
                         problem.switch_cost_j)
    return SolveResult(frontier, None, time.perf_counter() - started, in_background, measured)


class BackgroundSolve:
    """One frontier solve running in a child process; poll `result()` once per iteration."""

    def __init__(self, problem: SolveProblem) -> None:
        self._result: SolveResult | None = None
        self._chunks: list[bytes] = []
        self._process = subprocess.Popen(
            [sys.executable, "-m", "perseus_ext.runtime.solver_process", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_environment(os.environ),
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(pickle.dumps(problem))
        self._process.stdin.close()
        os.set_blocking(self._process.stdout.fileno(), False)

    def result(self) -> SolveResult | None:
        """The result once the child has finished, None while it still runs; never blocks."""
        if self._result is not None:
            return self._result
        if not self._drain():
            return None
        code = self._process.wait()
        self._process.stdout.close()
        try:
            outcome = pickle.loads(b"".join(self._chunks)) if code == 0 else None
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            outcome = SolveResult(None, f"cannot read the solver's output: {err}", 0.0, True)
        if not isinstance(outcome, SolveResult):
            outcome = SolveResult(None, f"the solver process exited with code {code}", 0.0, True)
        self._chunks.clear()
        self._result = outcome
        return outcome

    def _drain(self) -> bool:
        """Read what the child wrote so far; True at end of output."""
        fd = self._process.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, READ_CHUNK_BYTES)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            self._chunks.append(chunk)

    def cancel(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if not self._process.stdout.closed:
            self._process.stdout.close()


def child_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The solver child's environment: the parent's, with this package importable and
    OpenBLAS on one thread (the solver's numpy work is elementwise; OpenBLAS would otherwise
    start a thread per core of a GPU host in the child). A user's own OpenBLAS setting stays,
    as in `perseus-ext frontier`."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(parent, PYTHONPATH=os.pathsep.join(filter(None, [package_root, parent.get("PYTHONPATH")])))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies (elsewhere the parent check remains)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _main(parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    os.nice(NICENESS)
    keep_freed_memory()
    output = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # only the pickled result goes to the parent's pipe
    problem = pickle.loads(sys.stdin.buffer.read())
    output.write(pickle.dumps(solve(problem, in_background=True)))
    output.close()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
