"""Solving the frontier in a child process, so training keeps its CPU and its GIL meanwhile.

Why a fresh interpreter (`python -m perseus_ext.runtime.solver_process`) rather than a thread or
`multiprocessing`: a solver thread competes for the GIL with the training loop's Python (in
tests it slowed training iterations by half while solving), and `multiprocessing`'s spawn and
forkserver modes re-import the training script's `__main__`, which would start a second training
run in scripts without a main guard. The child lowers its own priority, reads a pickled problem
on stdin and writes the frontier as JSON to a file.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule

NICENESS = 10


def solve(
    schedule: PipelineSchedule, profile: Profile, blocking_power: float, options: Any = None
) -> dict[str, Any]:
    """{"frontier": Frontier dict} or {"error": message}; never raises.

    options: a `perseus_ext.planning.solver.SolverOptions` or None for the solver's defaults.
    """
    try:
        from perseus_ext.planning.solver import solve_frontier

        frontier = solve_frontier(schedule, profile.pareto(), blocking_power, options)
        return {"frontier": frontier.to_dict()}
    except Exception as err:  # reported to every rank of the pipeline instead
        return {"error": f"{type(err).__name__}: {err}"}


class BackgroundSolve:
    """One frontier solve running in a child process; poll `result()` once per iteration."""

    def __init__(
        self, schedule: PipelineSchedule, profile: Profile, blocking_power: float, options: Any = None
    ) -> None:
        self._result: dict[str, Any] | None = None
        handle, self._output = tempfile.mkstemp(prefix="perseus-frontier-", suffix=".json")
        os.close(handle)
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "perseus_ext.runtime.solver_process", self._output],
            stdin=subprocess.PIPE, env=env,
        )
        assert self._process.stdin is not None
        self._process.stdin.write(pickle.dumps((schedule, profile, blocking_power, options)))
        self._process.stdin.close()

    def result(self) -> dict[str, Any] | None:
        """The outcome once the child has exited, None while it still runs."""
        if self._result is None:
            code = self._process.poll()
            if code is None:
                return None
            try:
                if code != 0:
                    self._result = {"error": f"the solver process exited with code {code}"}
                else:
                    self._result = json.loads(Path(self._output).read_text())
            except (OSError, ValueError) as err:
                self._result = {"error": f"cannot read the solver's output: {err}"}
            Path(self._output).unlink(missing_ok=True)
        return self._result

    def cancel(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        Path(self._output).unlink(missing_ok=True)


def _main(output: str) -> None:
    os.nice(NICENESS)
    problem = pickle.loads(sys.stdin.buffer.read())
    Path(output).write_text(json.dumps(solve(*problem)))


if __name__ == "__main__":
    _main(sys.argv[1])
