"""The measured power swing of a running job: this rank's and, at close, the job's.

Why a reduction: the job's swing is that of the SUM of every GPU's power, which no rank sees.
Every rank's iteration records carry its device's power per millisecond of device time on one
grid (`observability.power_samples`), so the ranks first agree on the iterations and the device
time they all cover (two small reductions over the control plane: the last deployed iteration,
then three figures per iteration of the last `MAX_ITERATIONS`), then sum their samples over that
window (one reduction of at most `MAX_BINS` numbers). Every rank makes the same calls in the same
order whatever it holds (a rank without samples contributes neutral values), so no rank waits
for a reduction another skipped. `perseus-ext report` computes the same figures from the logs
(`observability.power_samples.job_swing`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.power_samples import (
    MAX_ITERATIONS,
    NO_SHARED_RUN,
    NOT_MEASURED,
    IterationPower,
    PowerSamples,
    deployed_run,
    job_window,
    joined,
    rank_swing,
    swing_summary,
)
from perseus_ext.observability.run_figures import Sample

if TYPE_CHECKING:
    from perseus_ext.runtime.comm import ControlPlane

logger = logging.getLogger(__name__)

NEUTRAL = -1e300  # contributes nothing to a max


def iteration_powers(history: Sequence[IterationRecord]) -> list[IterationPower]:
    """The records' power samples with the plan each deployed iteration ran."""
    powers = (Sample.of_record(record).iteration_power() for record in history)
    return [power for power in powers if power is not None]


def rank_power_swing(history: Sequence[IterationRecord]) -> dict[str, Any]:
    """This rank's measured swing over its last deployed run, or why there is none."""
    powers = iteration_powers(history)
    return rank_swing(deployed_run(powers), bool(powers))


def gather_job_swing(comm: ControlPlane, history: Sequence[IterationRecord],
                     deadline_s: float | None) -> dict[str, Any]:
    """The job's measured swing, the same on every rank (module doc), or why there is none.
    Never raises: a reduction that fails or times out costs the figure, not the summary."""
    ranks = len(comm.members)
    run = deployed_run(iteration_powers(history))
    try:
        (last,) = comm.all_reduce_by([run[-1].iteration if run else -1.0], "max", deadline_s)
        if last < 0:
            return {"measured": False, "why": "no rank has deployed iterations with power samples: " + NOT_MEASURED}
        first_iteration = int(last) - MAX_ITERATIONS + 1
        by_iteration = {item.iteration: item for item in run}
        figures: list[float] = []
        for iteration in range(first_iteration, int(last) + 1):
            item = by_iteration.get(iteration)
            # -1 from every rank (max -1): all hold it; 0 from any rank that does not
            figures += [0.0, NEUTRAL, NEUTRAL] if item is None else [
                -1.0, item.samples.first_bin, -item.samples.end_bin]
        reduced = comm.all_reduce_by(figures, "max", deadline_s)
        view = [(first_iteration + k, ranks if reduced[3 * k] == -1.0 else 0, int(reduced[3 * k + 1]),
                 int(-reduced[3 * k + 2])) for k in range(MAX_ITERATIONS)]
        window = job_window(view, ranks)
        if window is None:
            return {"measured": False, "why": NO_SHARED_RUN}
        # every rank makes this call once the window is agreed; a rank without it has no samples
        # there, and then the window cannot exist (every rank holds each of its iterations)
        own = joined(run).window(window.first_bin, window.end_bin)
        total = comm.all_reduce_by(own.tolist(), "sum", deadline_s)
    except Exception as err:  # the figure only: the job's other figures stand
        logger.debug("perseus-ext: the job's power swing was not gathered: %s", err)
        return {"measured": False, "why": f"gathering the ranks' power samples failed: {err}"}
    period = run[0].samples.period_s
    return swing_summary(PowerSamples(period, window.first_bin, np.asarray(total)), window.iterations, ranks)
