"""The pure statistics of a run's iterations: samples, the measured saving against the baseline
probes with its interval, default-clock figures and what each phase cost.

Why here, apart from the probes that decide which iterations run default clocks
(`perseus_ext.runtime.baseline`): the same figures come from two places -- the runtime's close,
from its iteration records, and `perseus-ext report`, from the JSONL logs -- and the report must
not need the runtime to compute them. Both feed `RunFigures` one `Sample` at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.power_samples import IterationPower, PowerSamples
from perseus_ext.observability.saving_estimate import CONFIDENCE, Comparison, Moments

PROBE = "baseline probe"
FALLBACK = "fallback"
DEPLOYED = "deployed"
MIXED = "mixed"  # ranks ran different settings in one iteration
# The probe schedule's promise to a short job (`runtime.baseline.ProbeSchedule`), quoted when a run
# ends without a measured saving: the first EARLY_ITERATIONS deployed iterations probe one in
# every EARLY_PERIOD at least (4 probes in the first 50).
EARLY_ITERATIONS = 50
EARLY_PERIOD = 12


@dataclass(frozen=True)
class Sample:
    """One iteration as the estimator sees it: a rank's record, a JSONL row, or a whole job's
    iteration (energy summed over ranks, time of the slowest)."""

    iteration: int
    label: str  # the phase, or "baseline probe" / "fallback"
    factor: float | None
    time_s: float
    energy_j: float | None
    plan: int | None = None  # the deployed plan, in an iteration that ran one (not a probe, no fallback)
    power: PowerSamples | None = None  # fine power samples, where the device gives them

    @classmethod
    def of_record(cls, record: IterationRecord) -> Sample:
        setting = record.setting
        label = label_of(setting.phase.value, setting.fell_back, setting.probe)
        return cls(setting.iteration, label, setting.factor, record.time_s, record.energy_j,
                   setting.plan if label == DEPLOYED else None, record.power)

    def iteration_power(self) -> IterationPower | None:
        """The sample's power with its plan, for the measured swing (None without samples)."""
        return None if self.power is None else IterationPower(self.iteration, self.plan, self.power)


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
    label = labels.pop() if len(labels) == 1 else FALLBACK if FALLBACK in labels else MIXED
    energies = [sample.energy_j for sample in row]
    factors = [sample.factor for sample in row if sample.factor is not None]
    return Sample(iteration, label, max(factors) if factors else None, max(s.time_s for s in row),
                  None if None in energies else float(sum(energies)))


REGIMES = {"all": lambda factor: True, "intrinsic": lambda factor: (factor or 1.0) <= 1.0,
           "extrinsic": lambda factor: (factor or 1.0) > 1.0}


@dataclass
class LabelTotals:
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
        self._labels: dict[str, LabelTotals] = {}

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
        totals = self._labels.setdefault(sample.label, LabelTotals())
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
