"""Baseline probes: rare deployed iterations at default clocks, and the saving measured from them.

Why: a real job has no side-by-side twin at default clocks, and the default-clock iterations it
does have (warm-up, solving) overlap one-off costs -- allocation, profiling's after-effects, the
background solve -- so comparing against them gave anything from -17 % to +49 % "saved". Instead,
while a plan is deployed, about `baseline_fraction` of the iterations run at default clocks
("probes"), spread evenly through the deployed period, so they see the same job conditions
(stragglers included) as the plan iterations around them. The saving is 1 - mean deployed energy
/ mean probe energy, with a confidence interval (delta method for a ratio of means, Welch's
degrees of freedom); the intrinsic/extrinsic split compares probes and plans of the same regime
(fastest plan vs slowed for a straggler).

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
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from scipy import stats

from perseus_ext.runtime.phase import Phase
from perseus_ext.runtime.records import IterationRecord

MAX_GUARD_ITERATIONS = 2
CONFIDENCE = 0.95
PROBE = "baseline probe"
FALLBACK = "fallback"
DEPLOYED = "deployed"


def probe_guard(check_interval: int) -> int:
    """Iterations kept clear of a straggler check on either side: two, fewer when checks come
    so often that two would leave no iteration to probe."""
    return min(MAX_GUARD_ITERATIONS, check_interval // 2)


EARLY_ITERATIONS = 50  # a job of this many deployed iterations gets a measured saving by default
EARLY_PERIOD = 12  # ... from a probe in every 12 of them at least: 4 probes in the first 50


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


# ------------------------------------------------------------------------------ estimator
@dataclass
class Moments:
    """Running count, mean and sum of squared deviations (Welford): O(1) per iteration."""

    count: int = 0
    mean: float = 0.0
    squares: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.squares += delta * (value - self.mean)

    @classmethod
    def of(cls, values: Iterable[float]) -> Moments:
        moments = cls()
        for value in values:
            moments.add(value)
        return moments

    @property
    def variance_of_mean(self) -> float:
        return self.squares / (self.count - 1) / self.count if self.count > 1 else math.nan


@dataclass(frozen=True)
class Ratio:
    """mean(numerator) / mean(denominator) with its confidence interval (None with fewer than
    two samples on either side)."""

    value: float
    low: float | None
    high: float | None

    @classmethod
    def of(cls, numerator: Moments, denominator: Moments, confidence: float = CONFIDENCE) -> Ratio:
        value = numerator.mean / denominator.mean
        if numerator.count < 2 or denominator.count < 2:
            return cls(value, None, None)
        a = numerator.variance_of_mean / numerator.mean ** 2
        b = denominator.variance_of_mean / denominator.mean ** 2
        if a + b == 0.0:
            return cls(value, value, value)
        dof = (a + b) ** 2 / (a * a / (numerator.count - 1) + b * b / (denominator.count - 1))
        half = stats.t.ppf(0.5 + confidence / 2, dof) * value * math.sqrt(a + b)
        return cls(value, value - half, value + half)


@dataclass(frozen=True)
class Comparison:
    """Deployed iterations against the probes among them: per-iteration means, the energy
    saving (1 - deployed / default) and time change (deployed / default - 1), each with its
    interval at `CONFIDENCE`."""

    probes: int
    deployed: int
    default_energy_j: float
    deployed_energy_j: float
    default_time_s: float
    deployed_time_s: float
    saving: float
    saving_low: float | None
    saving_high: float | None
    time_change: float
    time_change_low: float | None
    time_change_high: float | None

    @classmethod
    def of(cls, default: tuple[Moments, Moments], deployed: tuple[Moments, Moments],
           confidence: float = CONFIDENCE) -> Comparison | None:
        """(energy, time) moments of the probes and of the plan iterations; None until both
        have an energy reading."""
        (default_energy, default_time), (deployed_energy, deployed_time) = default, deployed
        if default_energy.count == 0 or deployed_energy.count == 0 or default_energy.mean <= 0:
            return None
        energy = Ratio.of(deployed_energy, default_energy, confidence)
        time = Ratio.of(deployed_time, default_time, confidence)
        return cls(
            probes=default_energy.count, deployed=deployed_energy.count,
            default_energy_j=default_energy.mean, deployed_energy_j=deployed_energy.mean,
            default_time_s=default_time.mean, deployed_time_s=deployed_time.mean,
            saving=1.0 - energy.value,
            saving_low=None if energy.high is None else 1.0 - energy.high,
            saving_high=None if energy.low is None else 1.0 - energy.low,
            time_change=time.value - 1.0,
            time_change_low=None if time.low is None else time.low - 1.0,
            time_change_high=None if time.high is None else time.high - 1.0,
        )

    def describe(self) -> str:
        """'23.1% [19.0, 27.2] (12 probes)': the saving and its interval, in percent."""
        interval = ("" if self.saving_low is None
                    else f" [{100 * self.saving_low:.1f}, {100 * self.saving_high:.1f}]")
        return f"{100 * self.saving:.1f}%{interval} ({self.probes} probe{'s' * (self.probes != 1)})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ samples
@dataclass(frozen=True)
class Sample:
    """One iteration as the estimator sees it: a rank's record, a JSONL row, or a whole job's
    iteration (energy summed over ranks, time of the slowest)."""

    iteration: int
    label: str  # the phase, or "baseline probe" / "fallback"
    factor: float | None
    time_s: float
    energy_j: float | None

    @classmethod
    def of_record(cls, record: IterationRecord) -> Sample:
        setting = record.setting
        return cls(setting.iteration, label_of(setting.phase.value, setting.fell_back, setting.probe),
                   setting.factor, record.time_s, record.energy_j)

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> Sample:
        """A row of the runtime's JSONL log (`log_path`)."""
        return cls(int(row["iteration"]), label_of(row["phase"], bool(row.get("fell_back")), bool(row.get("probe"))),
                   row.get("factor"), float(row["time_s"]), row.get("energy_j"))


def label_of(phase: str, fell_back: bool, probe: bool) -> str:
    """What an iteration really ran: a fallen-back rank's iterations are default-clock ones
    whatever the phase, and probes are default-clock iterations within the deployed phase."""
    return FALLBACK if fell_back else PROBE if probe else phase


def job_samples(ranks: Iterable[Iterable[Sample]]) -> list[Sample]:
    """Per-iteration job figures from every rank's samples: energy summed over the ranks, time
    of the slowest, only iterations every rank recorded. An iteration is a probe (or a plan
    iteration) only when every rank says so; the job's factor is the largest (any slowed
    pipeline puts the job in the straggler regime)."""
    by_rank = [{sample.iteration: sample for sample in samples} for samples in ranks]
    if not by_rank:
        return []
    common = sorted(set.intersection(*(set(samples) for samples in by_rank)))
    return [job_sample(iteration, [samples[iteration] for samples in by_rank]) for iteration in common]


def job_sample(iteration: int, row: list[Sample]) -> Sample:
    """The job's iteration from every rank's sample of it (see `job_samples`)."""
    labels = {sample.label for sample in row}
    label = labels.pop() if len(labels) == 1 else FALLBACK if FALLBACK in labels else "mixed"
    energies = [sample.energy_j for sample in row]
    factors = [sample.factor for sample in row if sample.factor is not None]
    return Sample(iteration, label, max(factors) if factors else None, max(s.time_s for s in row),
                  None if None in energies else float(sum(energies)))


REGIMES = {"all": lambda factor: True, "intrinsic": lambda factor: (factor or 1.0) <= 1.0,
           "extrinsic": lambda factor: (factor or 1.0) > 1.0}


@dataclass
class _LabelTotals:
    iterations: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    energies: int = 0


class RunFigures:
    """The measured saving, default-clock figures and phase costs of a run's samples, fed one
    sample at a time in iteration order: O(labels) memory, so `perseus-ext report` reads logs of
    any length in constant memory and the runtime's close computes the very same figures."""

    def __init__(self, confidence: float = CONFIDENCE) -> None:
        self.confidence = confidence
        self.iterations = 0
        self._moments = {(side, regime): (Moments(), Moments()) for side in (PROBE, DEPLOYED) for regime in REGIMES}
        self._counts = {PROBE: 0, DEPLOYED: 0}
        self._measured_energy_j = {PROBE: 0.0, DEPLOYED: 0.0}
        self._observing = (Moments(), Moments())
        self._observing_seen = 0
        self._labels: dict[str, _LabelTotals] = {}

    def add(self, sample: Sample) -> None:
        self.iterations += 1
        side = sample.label if sample.label in self._counts else None
        if side is not None:
            self._counts[side] += 1
            if sample.energy_j is not None:
                self._measured_energy_j[side] += sample.energy_j
                for regime, keep in REGIMES.items():
                    if keep(sample.factor):
                        energy, time = self._moments[side, regime]
                        energy.add(sample.energy_j)
                        time.add(sample.time_s)
        if sample.label == "observing":
            self._observing_seen += 1
            if self._observing_seen > 1 and sample.energy_j is not None:  # the first carries one-off costs
                self._observing[0].add(sample.energy_j)
                self._observing[1].add(sample.time_s)
        totals = self._labels.setdefault(sample.label, _LabelTotals())
        totals.iterations += 1
        totals.time_s += sample.time_s
        if sample.energy_j is not None:
            totals.energy_j += sample.energy_j
            totals.energies += 1

    def measured(self) -> dict[str, Any]:
        """The deployed iterations against the probes among them: over all of them, per regime
        (fastest plan: intrinsic; slowed for a straggler: intrinsic plus extrinsic), and what the
        probes themselves cost (the saving forgone on them)."""
        result: dict[str, Any] = {}
        for regime in REGIMES:
            comparison = Comparison.of(self._moments[PROBE, regime], self._moments[DEPLOYED, regime], self.confidence)
            result[regime] = comparison.to_dict() if comparison is not None else None
        probes, deployed = self._counts[PROBE], self._counts[DEPLOYED]
        overall = result["all"]
        if overall is not None:
            forgone_j = overall["probes"] * (overall["default_energy_j"] - overall["deployed_energy_j"])
            total_j = self._measured_energy_j[PROBE] + self._measured_energy_j[DEPLOYED]
            result["probe_cost"] = {"probes": probes, "share_of_deployed": probes / (probes + deployed),
                                    "energy_j": forgone_j, "share_of_energy": forgone_j / total_j if total_j else None}
        else:
            result["probe_cost"] = {"probes": probes, "share_of_deployed": None, "energy_j": None,
                                    "share_of_energy": None}
        return result

    def default_per_iteration(self, measured: Mapping[str, Any]) -> tuple[float | None, float | None]:
        """Default-clock energy and time per iteration: from the probes, else from an observing
        run's iterations (the first is skipped: it carries one-off allocation costs)."""
        overall = measured.get("all")
        if overall is not None:
            return overall["default_energy_j"], overall["default_time_s"]
        energy, time = self._observing
        return (energy.mean, time.mean) if energy.count else (None, None)

    def phase_costs(self, default_energy_j: float | None, default_time_s: float | None) -> dict[str, Any]:
        """Iterations, total time and energy per label (warm-up, profiling, solving, deployed,
        probes, ...), and what each cost beyond default clocks when a default-clock figure is
        known (from the probes, or from a run that only observed)."""
        result: dict[str, Any] = {}
        for label, totals in self._labels.items():
            energy_j = totals.energy_j if totals.energies else None
            result[label] = {
                "iterations": totals.iterations, "time_s": totals.time_s, "energy_j": energy_j,
                "time_per_iteration_s": totals.time_s / totals.iterations,
                "energy_per_iteration_j": energy_j / totals.energies if totals.energies else None,
                "extra_time_s": None if default_time_s is None else totals.time_s - totals.iterations * default_time_s,
                "extra_energy_j": (None if default_energy_j is None or not totals.energies
                                   else energy_j - totals.energies * default_energy_j),
            }
        return result

    def figures(self) -> dict[str, Any]:
        """What `perseus-ext report` and the runtime's job summary print."""
        measured = self.measured()
        default_energy_j, default_time_s = self.default_per_iteration(measured)
        return {"iterations": self.iterations, "measured": measured,
                "default_per_iteration": {"energy_j": default_energy_j, "time_s": default_time_s},
                "phase_costs": self.phase_costs(default_energy_j, default_time_s)}

    @classmethod
    def of(cls, samples: Iterable[Sample], confidence: float = CONFIDENCE) -> RunFigures:
        figures = cls(confidence)
        for sample in samples:
            figures.add(sample)
        return figures


def measured_counterfactual(samples: Iterable[Sample], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """`RunFigures.measured` of `samples`."""
    return RunFigures.of(samples, confidence).measured()


def phase_costs(samples: Iterable[Sample], default_energy_j: float | None, default_time_s: float | None) -> dict[str, Any]:
    """`RunFigures.phase_costs` of `samples`."""
    return RunFigures.of(samples).phase_costs(default_energy_j, default_time_s)


# ------------------------------------------------------------------------------ runtime side
class BaselineProbes:
    """The runtime's collaborator: is this deployed iteration a probe, and the saving so far
    (running moments, so the log line and monitors cost O(1) per iteration)."""

    def __init__(self, fraction: float, check_interval: int) -> None:
        self.schedule = ProbeSchedule(fraction, check_interval)
        self._default = (Moments(), Moments())
        self._deployed = (Moments(), Moments())
        self._profiling = _LabelTotals()
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
        """The saving measured so far on this rank (None before the first probe is recorded)."""
        return Comparison.of(self._default, self._deployed)


def payback_line(estimate: Comparison, profiling: _LabelTotals) -> str:
    """Profiling's cost against default clocks, on this GPU: its extra energy plus its extra time
    priced at the default-clock power (what the GPU would have drawn running on for that time),
    repaid by the measured saving per deployed iteration."""
    if profiling.iterations == 0 or not profiling.energies:
        return f"measured saving {estimate.describe()}; no profiling this run (a saved profile), nothing to repay"
    extra_time_s = profiling.time_s - profiling.iterations * estimate.default_time_s
    extra_energy_j = profiling.energy_j - profiling.energies * estimate.default_energy_j
    default_power_w = estimate.default_energy_j / estimate.default_time_s
    cost_j = extra_energy_j + max(extra_time_s, 0.0) * default_power_w
    saved_j = estimate.default_energy_j - estimate.deployed_energy_j
    spent = (f"profiling ({profiling.iterations} iterations) cost {extra_time_s:+.2f} s and {extra_energy_j:+.0f} J "
             f"vs default clocks, {cost_j:.0f} J with the extra time at the default-clock {default_power_w:.0f} W")
    if cost_j <= 0:
        return f"{spent}: nothing to repay; measured saving {estimate.describe()}"
    if saved_j <= 0:
        return f"{spent}; measured saving {estimate.describe()}: not repaid at this saving"
    return (f"{spent}; the measured saving, {saved_j:.1f} J/iteration ({estimate.describe()}), repays it after "
            f"{math.ceil(cost_j / saved_j)} deployed iterations")


def no_saving_reason(phase_costs: Mapping[str, Any], baseline_fraction: float | None = None) -> str:
    """Why a run has no measured saving, from what it ran (its `phase_costs` labels): only the
    reason that applies."""
    deployed = phase_costs.get(DEPLOYED, {}).get("iterations", 0)
    probes = phase_costs.get(PROBE, {}).get("iterations", 0)
    fraction = "" if baseline_fraction is None else f" {baseline_fraction:g}"
    if deployed == 0 and probes == 0:
        if "observing" in phase_costs:
            return "the run only observed (mode observe): default clocks throughout, nothing to compare"
        return "no plan was deployed (the run ended before: warm-up, profiling or solving)"
    if probes == 0:
        if baseline_fraction == 0:
            return f"{deployed} deployed iterations and no baseline probe: perseus.baseline_fraction is 0"
        return (f"{deployed} deployed iterations and no baseline probe yet (perseus.baseline_fraction{fraction}: the "
                f"first comes within {EARLY_PERIOD} deployed iterations)")
    if deployed == 0:
        return f"{probes} baseline probes but no iteration ran a plan (they fell back)"
    return f"{probes} baseline probe(s) without an energy reading"
