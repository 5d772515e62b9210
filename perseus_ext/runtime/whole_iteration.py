"""Whole-iteration mode: the adapter reports iterations only, each one unit the hooks cannot
look into (a full-iteration CUDA graph replay).

Every iteration is then one span on the device at one clock per stage, set before it and
released after it, so the deployed plans are stage-constant (`planning/stage_constant.py`) and
solved from a saved profile (`profile_path`): computations cannot be profiled one by one.
"""

from __future__ import annotations

import logging

from perseus_ext.actuation.sequencer import ClockSequencer
from perseus_ext.errors import PerseusError
from perseus_ext.measurement.pacing import ComputationPacer
from perseus_ext.planning.schedule import Computation
from perseus_ext.runtime.deployment import PlanDeployment

logger = logging.getLogger("perseus_ext.runtime.runtime")  # the runtime's own log lines

SPANS_PER_ITERATION = 1


def stage_clock(deployment: PlanDeployment, stage: int) -> tuple[int]:
    """The deployed plan's one clock for `stage` over the whole iteration; PerseusError when the
    plan is not stage-constant."""
    clocks = deployment.stage_clocks(stage)
    if len(set(clocks)) != 1:
        raise PerseusError(f"whole-iteration mode deploys stage-constant plans; stage "
                           f"{stage} was given {sorted(set(clocks))} MHz")
    return (clocks[0],)


def replay_launched(iteration: int, order: tuple[Computation, ...], pacer: ComputationPacer,
                    sequencer: ClockSequencer) -> None:
    """The iteration (a graph replay) has been launched: its work is on the device (a simulated
    device gets it from the pacer now, computation by computation, with its pipeline
    dependencies); the stage's clock is released after it."""
    planned = sequencer.planned_clock()
    for computation in order:
        pacer.receive(iteration, computation)
        pacer.compute(iteration, computation, planned)
    sequencer.computation_finished()


def warn_nothing_to_solve_from() -> None:
    """Without a saved profile a whole-iteration job cannot be planned: say how to get one."""
    logger.warning("perseus-ext: each iteration runs as one full-iteration CUDA graph replay, whose "
                   "computations cannot be profiled one by one, and there is no saved profile "
                   "(perseus.profile_path): staying at default clocks. Run the job once without the "
                   "full-iteration graph with profile_path set (it saves the profile there), then "
                   "again with it")
