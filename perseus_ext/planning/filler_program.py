"""A swing-capped plan's filler as each stage runs it: windows of extra power while it waits.

A capped plan's `Filler` (`swing_cap.py`) says how many watts the pipeline's waiting GPUs draw
together above their blocking power in each segment of the iteration. A device draws power for
itself only, so the runtime needs, per stage, the windows in which that stage waits and what it
draws there: a `StageFillerProgram`.

The split rule: a segment's filler power is shared EVENLY among the stages that wait through the
whole segment (in the plan's model, the replay every planner figure comes from). Every stage has
the same headroom (`filler_max_w` minus the blocking power, as `swing_cap` allows), and the capped
planner only keeps plans whose filler fits that headroom summed over the waiting stages, so the
even share always fits; water-filling with equal caps is this even share, and it keeps the most
any one GPU draws (and heats up by) as low as the sum allows. A share that would exceed the
headroom (a filler the planner would not produce) is refused with `SolverError`.

Times: a window's `start_s` / `end_s` are offsets from the iteration's start in the plan's model.
A device cannot see the model's iteration start, and a device's iteration drifts from the model
by what the model leaves out (hand-over latencies, a host that launches late), so each wait is
anchored on the end of the stage's own computation that begins it: `by_computation()` gives,
for each computation of the stage, the windows of the wait that follows it as offsets from its
end (its end in the model: `ends_s`). A wait before the stage's first computation (the fill of
stages > 0) is the tail of the previous period, as iterations run back to back in the model, so
it follows the stage's last computation of the previous iteration.

A stage of `gpus_per_stage` tensor-parallel GPUs shares its windows' watts evenly among them
(`by_computation(gpus_per_stage)`): energies and blocking power in the planner are per stage.

`solve_capped` is the capped solve as the runtime runs it: with a filler where the devices can
draw one (`GPU.supports_power_floor`), clock-only plans elsewhere (`CappedPlans.filler`).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.power_swing import choices_of, computation_power

_MIN_SEGMENT_S = 1e-9  # as swing_cap: shorter segments are simultaneous events
_HEADROOM_SLACK_W = 1e-6


@dataclass(frozen=True)
class FillerWindow:
    """Extra power `watts` (above blocking power) from `start_s` to `end_s`, seconds."""

    start_s: float
    end_s: float
    watts: float

    @property
    def energy_j(self) -> float:
        return (self.end_s - self.start_s) * self.watts


@dataclass(frozen=True)
class StageFillerProgram:
    """One stage's share of a plan's filler (module doc): windows as offsets from the model's
    iteration start, the model end of each of the stage's computations (in its order), the
    stage's first computation start and the period."""

    stage: int
    windows: tuple[FillerWindow, ...]
    ends_s: tuple[float, ...]  # empty without windows
    first_start_s: float
    period_s: float

    @property
    def energy_j(self) -> float:
        return sum(window.energy_j for window in self.windows)

    def by_computation(self, gpus_per_stage: int = 1) -> tuple[tuple[FillerWindow, ...], ...]:
        """For each computation of the stage, the windows of the wait after it as offsets from its
        end (the fill before the first computation follows the last one), each GPU's share of a
        tensor-parallel stage's watts."""
        found: list[list[FillerWindow]] = [[] for _ in self.ends_s]
        last = len(self.ends_s) - 1
        for window in self.windows:
            if window.start_s < self.first_start_s - _MIN_SEGMENT_S:  # the fill: after the previous iteration
                j, shift = last, self.period_s - self.ends_s[last]
            else:
                j = max(bisect_right(self.ends_s, window.start_s + _MIN_SEGMENT_S) - 1, 0)
                shift = -self.ends_s[j]
            found[j].append(FillerWindow(max(window.start_s + shift, 0.0), window.end_s + shift,
                                         window.watts / gpus_per_stage))
        return tuple(tuple(sorted(windows, key=lambda w: w.start_s)) for windows in found)


@dataclass(frozen=True)
class PlanFiller:
    """What a capped plan asks of the devices, per stage, and the swing it was planned for."""

    swing_w: float  # the plan's pipeline swing in the model, filler included
    filler_energy_j: float  # the filler's energy per iteration (in the plan's energy)
    stages: tuple[StageFillerProgram, ...]
    meets_cap: bool  # as the capped planner found (`swing_cap.CappedPlan.meets_cap`)


@dataclass(frozen=True)
class CappedPlans:
    """A swing-capped frontier's plans with their fillers, in the frontier's order."""

    cap_fraction: float
    cap_w: float
    reference_swing_w: float  # the all-max-clock plan's swing the cap is a fraction of
    filler_max_w: float  # the most a waiting stage may draw
    filler: bool  # the devices draw the fillers (False: clock-only plans, no filler headroom)
    plans: tuple[PlanFiller, ...]

    def meets_cap(self, index: int) -> bool:
        return self.plans[index].meets_cap

    def for_stage(self, stage: int) -> CappedPlans:
        """What the rank that runs `stage` needs: every plan's figures, its own stage's program."""
        plans = tuple(PlanFiller(p.swing_w, p.filler_energy_j, tuple(s for s in p.stages if s.stage == stage),
                                 p.meets_cap) for p in self.plans)
        return CappedPlans(self.cap_fraction, self.cap_w, self.reference_swing_w, self.filler_max_w, self.filler, plans)

    def program(self, index: int, stage: int) -> StageFillerProgram | None:
        """Plan `index`'s program for `stage` (None: not held here)."""
        return next((s for s in self.plans[index].stages if s.stage == stage), None)


def split_filler(model, choice: np.ndarray, breakpoints_s: np.ndarray, power_w: np.ndarray,
                 filler_max_w: float) -> tuple[StageFillerProgram, ...]:
    """Each stage's program for the filler (`breakpoints_s`, `power_w`: a `swing_cap.Filler`) of
    the plan `choice` (option indices of `model`, a `CostModel`), by the module's split rule."""
    starts, finishes, _ = computation_power(model, np.asarray(choice)[:, None])
    starts, finishes = starts[:, 0], finishes[:, 0]
    period_s = float(finishes.max())
    headroom_w = filler_max_w - model.blocking_power
    stages = model.dag.stage_positions
    windows: list[list[FillerWindow]] = [[] for _ in stages]
    for low, high, watts in zip(breakpoints_s[:-1].tolist(), breakpoints_s[1:].tolist(), power_w.tolist()):
        if watts <= 0 or high - low <= _MIN_SEGMENT_S:
            continue
        overlap = _MIN_SEGMENT_S  # a computation touching the segment's edge does not overlap it
        waiting = [s for s, pos in enumerate(stages)
                   if not np.any((starts[pos] < high - overlap) & (finishes[pos] > low + overlap))]
        share = watts / len(waiting) if waiting else np.inf
        if share > headroom_w + _HEADROOM_SLACK_W:
            raise SolverError(
                f"a filler of {watts:.1f} W from {low:.6f} s to {high:.6f} s needs {share:.1f} W from each of "
                f"{len(waiting)} waiting stages, more than their headroom {headroom_w:.1f} W")
        for stage in waiting:
            _append(windows[stage], FillerWindow(low, high, share))
    # A stage without a window needs no anchors (what ships to its rank stays small).
    return tuple(StageFillerProgram(stage, tuple(found), tuple(finishes[stages[stage]].tolist()) if found else (),
                                    float(starts[stages[stage][0]]), period_s)
                 for stage, found in enumerate(windows))


def _append(windows: list[FillerWindow], window: FillerWindow) -> None:
    """Add `window`, merged into the last one when they touch at the same power."""
    if windows and abs(windows[-1].end_s - window.start_s) <= _MIN_SEGMENT_S \
            and abs(windows[-1].watts - window.watts) <= 1e-9:
        windows[-1] = FillerWindow(windows[-1].start_s, window.end_s, window.watts)
    else:
        windows.append(window)


def capped_plans(capped, schedule, profile, switch_latency_s: float, filler_max_w: float) -> CappedPlans:
    """The per-stage programs of every plan of a `swing_cap.CappedFrontier` (solved for
    `schedule` on `profile` with `switch_latency_s` and `filler_max_w`; at most the blocking
    power: clock-only plans)."""
    from perseus_ext.planning.energy import CostModel

    model = CostModel(schedule, profile, capped.frontier.blocking_power, switch_latency_s)
    filler = filler_max_w > model.blocking_power
    choices = choices_of(model, [p.plan for p in capped.plans]) if filler else None
    plans = tuple(  # clock-only plans have no programs: no stage draws anything
        PlanFiller(float(p.swing.peak_to_trough_w), float(p.filler.energy_j),
                   split_filler(model, choices[:, k], p.filler.breakpoints_s, p.filler.power_w, filler_max_w)
                   if filler else (), bool(p.meets_cap))
        for k, p in enumerate(capped.plans))
    return CappedPlans(float(capped.cap_fraction), float(capped.cap_w), float(capped.reference.peak_to_trough_w),
                       float(filler_max_w), filler, plans)


def solve_capped(schedule, profile, blocking_power: float, options, switch_latency_s: float = 0.0, *,
                 power_floor: bool):
    """The swing-capped frontier and its fillers (`CappedPlans`), as the runtime deploys them.

    `power_floor`: whether the devices can draw a stated filler power (`GPU.supports_power_floor`).
    Where they can, a waiting stage may draw up to `swing_cap`'s default (the highest profiled
    power); where they cannot, up to its blocking power, i.e. no filler: the plans are clock-only,
    and their energy is what the devices run (their swing may then miss the cap; `CappedPlans`
    says). Solved without a wait-aware extension: a capped frontier has none."""
    from perseus_ext.planning.solver import solve_capped_frontier
    from perseus_ext.planning.swing_cap import highest_power_w

    filler_max_w = highest_power_w(profile) if power_floor else blocking_power
    capped = solve_capped_frontier(schedule, profile, blocking_power, options, switch_latency_s,
                                   filler_max_w=filler_max_w)
    return capped.frontier, capped_plans(capped, schedule, profile, switch_latency_s, filler_max_w)
