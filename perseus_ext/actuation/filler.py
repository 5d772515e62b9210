"""A swing-capped plan's filler drawn by the device, or, where it cannot be, said so.

A capped plan's energy and swing count a filler: power drawn while GPUs wait
(`planning/filler_program.py` splits it per stage). The runtime deploys a plan's clocks through
the sequencer; this deploys its filler. As each computation of a deployed iteration is launched,
on the training thread, it hands the device the power floors of the wait that follows that
computation, anchored on the computation's end marker: the device holds them from where IT is
(offsets from the computation's end in the plan's model), so nothing waits for the device, no
host clock is involved, and a device running late or early against the model (hand-over
latencies, a host that launches late) shifts each wait's filler with the wait. The device ends a
wait's floors when it starts its next work, and holds the last one on while a wait runs longer
than planned, by at most the wait's planned filler span (a wait up to about twice as long as
planned stays filled; a pause for a checkpoint does not burn power). The wait after a stage's
last computation runs into the next iteration's fill (iterations back to back), so it is handed
on at the next iteration's start, anchored on its start marker, which the device reaches as it
ends the previous iteration's last work (after the gradient sync, where one runs: the pipeline
swing a cap bounds leaves that gap out). So the fill is the next iteration's plan's, whatever the
previous iteration ran (the first deployed iteration, after a baseline probe or a plan switch).

A device that cannot draw a stated power (`GPU.supports_power_floor`) was planned for without a
filler (clock-only plans); then this only says, once per plan, what swing the plan's clocks reach
against the cap.
"""

from __future__ import annotations

import logging

from perseus_ext.measurement.gpu.common import GPU, PowerFloor
from perseus_ext.measurement.gpu.timeline import DeviceMarker
from perseus_ext.planning.filler_program import CappedPlans

logger = logging.getLogger(__name__)


class FillerPlayer:
    """One rank's part of the deployed capped plans' fillers (module doc)."""

    def __init__(self, gpu: GPU | None, capped: CappedPlans, stage: int, gpus_per_stage: int, *,
                 speaks_for_pipeline: str | None = None) -> None:
        """`speaks_for_pipeline`: the name this rank logs each deployed plan's swing under
        (one rank per job logs it; None: this rank does not)."""
        self.gpu = gpu
        self.capped = capped
        self.stage = stage
        self.gpus_per_stage = gpus_per_stage
        self.speaks_for = speaks_for_pipeline
        self.disabled_reason: str | None = None
        self.floors_held = 0  # waits whose floors the device was handed
        self._floors: dict[int, tuple[tuple[PowerFloor, ...], ...]] = {}
        self._announced: set[int] = set()

    def floors(self, plan: int) -> tuple[tuple[PowerFloor, ...], ...]:
        """Plan `plan`'s floors for this rank's device: for each computation of the stage, those
        of the wait after it, as offsets from its end (none without a filler)."""
        found = self._floors.get(plan)
        if found is None:
            program = self.capped.program(plan, self.stage) if self.capped.filler else None
            found = () if program is None else tuple(
                tuple(PowerFloor(w.start_s, w.end_s, w.watts) for w in windows if w.watts > 0)
                for windows in program.by_computation(self.gpus_per_stage))
            self._floors[plan] = found
        return found

    def iteration_started(self, plan: int | None, start: DeviceMarker) -> None:
        """A deployed iteration at plan `plan` starts at `start` (its start marker): the wait
        after the stage's last computation, running into this iteration's fill, from there."""
        if plan is None:
            return
        self._announce(plan)
        floors = self.floors(plan)
        if floors:
            self._hold(start, floors[-1])

    def computation_launched(self, plan: int | None, position: int, end: DeviceMarker) -> None:
        """Computation `position` of a deployed iteration at plan `plan` ends at `end` (a device
        marker): hand the device the floors of the wait after it. Never raises (a failing device
        call stops the filler, not training)."""
        if plan is None:  # default clocks (a baseline probe, a rank that fell back): no filler planned
            return
        self._announce(plan)
        floors = self.floors(plan)
        if position < len(floors) - 1:  # the last one's wait is handed on at the next iteration's start
            self._hold(end, floors[position])

    def _hold(self, anchor: DeviceMarker, wait: tuple[PowerFloor, ...]) -> None:
        """The device fills one wait from `anchor` on."""
        if not wait or self.disabled_reason is not None or self.gpu is None:
            return
        try:
            self.gpu.hold_power_floor(anchor, wait, hold_until_work_s=wait[-1].end_s - wait[0].start_s)
            self.floors_held += 1
        except Exception as err:
            self.disabled_reason = repr(err)
            logger.error("perseus-ext: stage %d: the device cannot draw the swing-capped plan's filler (%r); "
                         "from now on its plans' energy and swing count a filler that does not run", self.stage, err)

    def _announce(self, plan: int) -> None:
        """One line per plan deployed: its swing against the cap, met or not, and what runs."""
        if self.speaks_for is None or plan in self._announced:
            return
        self._announced.add(plan)
        capped, figures = self.capped, self.capped.plans[plan]
        verdict = "meets" if capped.meets_cap(plan) else "does NOT meet"
        if capped.filler:
            logger.info("perseus-ext: %s plan %d: pipeline swing %.0f W with its filler (%.1f J per iteration, "
                        "drawn by the devices while they wait), cap %g of the all-max-clock swing = %.0f W: it %s "
                        "the cap", self.speaks_for, plan, figures.swing_w, figures.filler_energy_j,
                        capped.cap_fraction, capped.cap_w, verdict)
        else:
            logger.info("perseus-ext: %s plan %d: the devices cannot draw a filler, so the plans are clock-only; "
                        "this plan's clocks reach a pipeline swing of %.0f W against the cap %g of the "
                        "all-max-clock swing = %.0f W: it %s the cap", self.speaks_for, plan, figures.swing_w,
                        capped.cap_fraction, capped.cap_w, verdict)
