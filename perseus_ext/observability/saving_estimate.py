"""The measured saving's estimator: running moments, a ratio of means with its confidence
interval, and the comparison of plan iterations with the baseline probes among them.

Why a ratio of means with the delta method: the saving is 1 - mean plan energy / mean probe
energy, and both means are noisy (the energy counter updates coarsely, stragglers come and go);
the interval (Welch's degrees of freedom) says how far the figure can be trusted. Why a
probes-needed projection: a short job's interval can be 190 points wide, or narrow by luck from
two probes; instead of such a figure the comparison says "too few probes: N, need M for ±5%",
M projected from the spread seen so far.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

from scipy import special  # the t quantile (stdtrit) without scipy.stats, half a second of every rank's start

CONFIDENCE = 0.95
# The interval's half-width, in points of saving, below which the evidence is enough to act on:
# savings are 5-30 %, so a wider interval cannot tell a useful plan from a useless one.
TARGET_HALF_WIDTH = 0.05
# Fewer probes than this give a spread that is itself a guess (two close probes make a narrow
# interval by luck): the evidence is thin whatever the interval says.
MIN_TRUSTED_PROBES = 5
PROJECTION_ROUNDS = 6  # fixed-point rounds of the probes-needed projection (t quantile vs count)


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
        half = special.stdtrit(dof, 0.5 + confidence / 2) * value * math.sqrt(a + b)
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
    # probes the interval needs to reach +-TARGET_HALF_WIDTH (None: it has, or no estimate)
    probes_needed: int | None = None
    # deployed iterations those probes take on this job's probe schedule (the runtime knows it)
    deployed_iterations_needed: int | None = None

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
            probes_needed=None if (default_energy.count >= MIN_TRUSTED_PROBES and energy.low is not None
                                   and (energy.high - energy.low) / 2 <= TARGET_HALF_WIDTH)
            else max(MIN_TRUSTED_PROBES, probes_needed(default_energy, deployed_energy, confidence) or 2),
        )

    @property
    def half_width(self) -> float | None:
        """Half the saving's interval, as a fraction (None without an interval)."""
        return None if self.saving_low is None else (self.saving_high - self.saving_low) / 2

    def evidence(self) -> str | None:
        """'too few probes: 2, need 31 for ±5%' (and the deployed iterations that takes, when
        known) when there are fewer than `MIN_TRUSTED_PROBES` probes or the interval is wider
        than ±TARGET_HALF_WIDTH; None when the evidence is enough."""
        if self.probes_needed is None:
            return None
        target = f"{100 * TARGET_HALF_WIDTH:g}%"
        text = f"too few probes: {self.probes}, need {self.probes_needed} for ±{target}"
        if self.deployed_iterations_needed is not None:
            text += f", about {self.deployed_iterations_needed} deployed iterations at this job's probe rate"
        return text

    def describe_with_evidence(self) -> str:
        """`describe`, then whether the evidence is thin; below `MIN_TRUSTED_PROBES` probes the
        interval is left out (its width would be a guess: [-82, 105] from two probes)."""
        evidence = self.evidence()
        if evidence is None:
            return self.describe()
        if self.probes < MIN_TRUSTED_PROBES:
            return f"{100 * self.saving:.1f}% (no interval yet: {evidence})"
        return f"{self.describe()}; {evidence}"

    def describe(self) -> str:
        """'23.1% [19.0, 27.2] (12 probes)': the saving and its interval, in percent."""
        interval = ("" if self.saving_low is None
                    else f" [{100 * self.saving_low:.1f}, {100 * self.saving_high:.1f}]")
        return f"{100 * self.saving:.1f}%{interval} ({self.probes} probe{'s' * (self.probes != 1)})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def probes_needed(default_energy: Moments, deployed_energy: Moments, confidence: float = CONFIDENCE,
                  target: float = TARGET_HALF_WIDTH) -> int | None:
    """How many probes the saving's interval needs for a half-width of `target`, projected from
    the spread seen so far, with the deployed iterations growing in step with the probes (the
    schedule keeps their ratio); at least one more than now. None without both sides. With one probe
    its spread is taken to be the deployed iterations' (the same GPU and job, another clock);
    with one of each nothing can be projected: 2, the least that gives an interval."""
    probes, deployed = default_energy.count, deployed_energy.count
    if probes == 0 or deployed == 0 or default_energy.mean <= 0 or deployed_energy.mean <= 0:
        return None
    deployed_spread = deployed_energy.squares / (deployed - 1) / deployed_energy.mean ** 2 if deployed > 1 else None
    probe_spread = default_energy.squares / (probes - 1) / default_energy.mean ** 2 if probes > 1 else deployed_spread
    if probe_spread is None:
        return 2
    deployed_spread = probe_spread if deployed_spread is None else deployed_spread
    ratio = deployed_energy.mean / default_energy.mean
    # relative variance of the ratio per probe, deployed iterations scaled with the probes
    per_probe = probe_spread + deployed_spread * probes / deployed
    needed = 2.0
    for _ in range(PROJECTION_ROUNDS):
        quantile = special.stdtrit(max(needed - 1.0, 1.0), 0.5 + confidence / 2)
        needed = max(2.0, (quantile * ratio / target) ** 2 * per_probe)
    return max(math.ceil(needed), probes + 1)
