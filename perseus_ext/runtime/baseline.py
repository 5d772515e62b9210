"""Baseline probes: rare deployed iterations at default clocks, and the saving measured from them.

Why: a real job has no side-by-side twin at default clocks, and the default-clock iterations it
does have (warm-up, solving) overlap one-off costs -- allocation, profiling's after-effects, the
background solve -- so comparing against them gave anything from -17 % to +49 % "saved". Instead,
while a plan is deployed, about `baseline_fraction` of the iterations run at default clocks
("probes"), spread evenly through the deployed period, so they see the same job conditions
(stragglers included) as the plan iterations around them. The saving is 1 - mean deployed energy
/ mean probe energy, with a confidence interval (delta method for a ratio of means, Welch's
degrees of freedom: `perseus_ext.observability.saving_estimate`, which also says when there are
too few probes for it, and how many more the schedule takes); the intrinsic/extrinsic split
compares probes and plans of the same regime (fastest plan vs slowed for a straggler).

The statistics themselves (samples, the saving and phase costs of a run) are
`perseus_ext.observability.run_figures`, which `perseus-ext report` shares without the runtime.

Which iterations probe is a pure function of the deployed-iteration count, the straggler-check
interval and the pipeline's last plan switch, so every rank derives the same probes without a
collective (plan switches are agreed within a pipeline by broadcast, straggler checks happen at
the same deployed iteration on every rank). One probe falls in the second half of every
`1 / baseline_fraction` deployed iterations, never within `guard` iterations of a straggler check
(where plans switch) or of any other plan switch. Warm-up, profiling and solving are never probed
and their iterations are reported as their own cost (`phase_costs`), never mixed into the saving.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.phase import Phase
from perseus_ext.observability.run_figures import EARLY_ITERATIONS, EARLY_PERIOD, LabelTotals
from perseus_ext.observability.saving_estimate import Comparison, Moments

MAX_GUARD_ITERATIONS = 2


def probe_guard(check_interval: int) -> int:
    """Iterations kept clear of a straggler check on either side: two, fewer when checks come
    so often that two would leave no iteration to probe."""
    return min(MAX_GUARD_ITERATIONS, check_interval // 2)


class ProbeSchedule:
    """Decides, identically on every rank, which deployed iterations run at default clocks.

    The first `EARLY_ITERATIONS` deployed iterations probe at least one in `EARLY_PERIOD` (with
    the default fraction of 0.01 a short job would otherwise end with no probe and no measured
    saving); from then on one in `1 / fraction`. A weeks-long job pays 4 early probes; a job of
    50 deployed iterations gets a saving with its interval."""

    def __init__(self, fraction: float, check_interval: int) -> None:
        self.period = round(1.0 / fraction) if fraction > 0 else None
        self.early = self.period is not None and self.period > EARLY_PERIOD
        self.check_interval = check_interval
        self.guard = probe_guard(check_interval)
        self._probed_period: tuple[bool, int] = (False, -1)

    def _window(self, deployed_index: int) -> tuple[tuple[bool, int], int, int]:
        """(window id, offset in it, its length) of a deployed iteration."""
        if self.early and deployed_index < EARLY_ITERATIONS:
            window, offset = divmod(deployed_index, EARLY_PERIOD)
            return (True, window), offset, EARLY_PERIOD
        start = EARLY_ITERATIONS if self.early else 0
        window, offset = divmod(deployed_index - start, self.period)
        return (False, window), offset, self.period

    def clear_of_checks(self, deployed_index: int) -> bool:
        """Whether the iteration is `guard` or more iterations from the nearest straggler check
        (a check runs after every `check_interval` deployed iterations; its plan runs from the
        next one, so the switch lands on a multiple of the interval)."""
        offset = deployed_index % self.check_interval
        return self.guard <= offset <= self.check_interval - self.guard

    def is_probe(self, deployed_index: int, iterations_since_switch: int | None) -> bool:
        """Call once per deployed iteration, in order. `deployed_index` counts deployed
        iterations from 0; `iterations_since_switch` is how many iterations ago the pipeline's
        latest plan took effect (None: no switch yet)."""
        if self.period is None:
            return False
        period, offset, length = self._window(deployed_index)
        if period == self._probed_period or offset < length // 2 or not self.clear_of_checks(deployed_index):
            return False
        if iterations_since_switch is not None and iterations_since_switch < self.guard:
            return False
        self._probed_period = period
        return True

    def deployed_iterations_for(self, probes: int) -> int | None:
        """About how many deployed iterations it takes to run `probes` probes (one per window,
        in its second half; plan switches push a probe a few iterations on): what a thin
        interval needs, said in the units a user controls. None when nothing probes."""
        if self.period is None or probes <= 0:
            return None if self.period is None else 0
        if not self.early:
            return probes * self.period
        early_probes = EARLY_ITERATIONS // EARLY_PERIOD
        if probes <= early_probes:
            return probes * EARLY_PERIOD
        return EARLY_ITERATIONS + (probes - early_probes) * self.period


# ------------------------------------------------------------------------------ runtime side
class BaselineProbes:
    """The runtime's collaborator: is this deployed iteration a probe, and the saving so far
    (running moments, so the log line and monitors cost O(1) per iteration)."""

    def __init__(self, fraction: float, check_interval: int) -> None:
        self.schedule = ProbeSchedule(fraction, check_interval)
        self._default = (Moments(), Moments())
        self._deployed = (Moments(), Moments())
        self._profiling = LabelTotals()
        self._payback_told = False

    def is_probe(self, deployed_index: int, iterations_since_switch: int | None) -> bool:
        return self.schedule.is_probe(deployed_index, iterations_since_switch)

    def observe(self, records: Iterable[IterationRecord]) -> None:
        for record in records:
            setting = record.setting
            if setting.phase is Phase.PROFILING and not setting.fell_back:
                self._profiling.iterations += 1
                self._profiling.time_s += record.time_s
                if record.energy_j is not None:
                    self._profiling.energy_j += record.energy_j
                    self._profiling.energies += 1
            if setting.fell_back or record.energy_j is None:
                continue
            target = self._default if setting.probe else self._deployed if setting.plan is not None else None
            if target is not None:
                target[0].add(record.energy_j)
                target[1].add(record.time_s)

    def payback_once(self) -> str | None:
        """Once, as soon as the saving has an interval: what profiling cost this GPU and after
        how many deployed iterations the measured saving repays it (None before, and after)."""
        if self._payback_told:
            return None
        estimate = self.estimate()
        if estimate is None or estimate.saving_low is None:
            return None
        self._payback_told = True
        return payback_line(estimate, self._profiling)

    def estimate(self) -> Comparison | None:
        """The saving measured so far on this rank (None before the first probe is recorded);
        when the interval is thin, with the deployed iterations its probes need."""
        estimate = Comparison.of(self._default, self._deployed)
        if estimate is None or estimate.probes_needed is None:
            return estimate
        return dataclasses.replace(
            estimate, deployed_iterations_needed=self.schedule.deployed_iterations_for(estimate.probes_needed))


def payback_line(estimate: Comparison, profiling: LabelTotals) -> str:
    """Profiling's cost against default clocks, on this GPU: its extra energy plus its extra time
    priced at the default-clock power (what the GPU would have drawn running on for that time),
    repaid by the measured saving per deployed iteration."""
    if profiling.iterations == 0 or not profiling.energies:
        return (f"this GPU's measured saving {estimate.describe_with_evidence()}; no profiling this run "
                "(a saved profile), nothing to repay")
    extra_time_s = profiling.time_s - profiling.iterations * estimate.default_time_s
    extra_energy_j = profiling.energy_j - profiling.energies * estimate.default_energy_j
    default_power_w = estimate.default_energy_j / estimate.default_time_s
    cost_j = extra_energy_j + max(extra_time_s, 0.0) * default_power_w
    saved_j = estimate.default_energy_j - estimate.deployed_energy_j
    spent = (f"profiling ({profiling.iterations} iterations) cost {extra_time_s:+.2f} s and {extra_energy_j:+.0f} J "
             f"vs default clocks, {cost_j:.0f} J with the extra time at the default-clock {default_power_w:.0f} W")
    if cost_j <= 0:
        return f"{spent}: nothing to repay; this GPU's measured saving {estimate.describe_with_evidence()}"
    if saved_j <= 0:
        return f"{spent}; this GPU's measured saving {estimate.describe_with_evidence()}: not repaid at this saving"
    return (f"{spent}; this GPU's measured saving, {saved_j:.1f} J/iteration "
            f"({estimate.describe_with_evidence()}), repays it after "
            f"{math.ceil(cost_j / saved_j)} deployed iterations")
