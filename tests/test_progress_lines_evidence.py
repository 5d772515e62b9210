"""A thin interval says so: "too few probes: N, need M for ±5%" instead of a 190-point interval.

The oracle for M is the thing it promises, checked by drawing fresh samples: with M probes (and
deployed iterations grown in step) the interval's half-width comes out near ±5 points, with
half of M it does not. The deployed iterations M probes take are checked against the probe
schedule itself, run iteration by iteration."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from perseus_ext.runtime.baseline import ProbeSchedule
from perseus_ext.observability.saving_estimate import MIN_TRUSTED_PROBES, TARGET_HALF_WIDTH, Comparison, Moments

PROBE_MEAN_J, PROBE_SD_J = 100.0, 15.0
PLAN_MEAN_J, PLAN_SD_J = 80.0, 12.0
DEPLOYED_PER_PROBE = 7


def draw(rng: np.random.Generator, probes: int) -> Comparison:
    default = rng.normal(PROBE_MEAN_J, PROBE_SD_J, size=probes)
    deployed = rng.normal(PLAN_MEAN_J, PLAN_SD_J, size=probes * DEPLOYED_PER_PROBE)
    comparison = Comparison.of((Moments.of(default), Moments.of(np.ones(probes))),
                               (Moments.of(deployed), Moments.of(np.ones(deployed.size))))
    assert comparison is not None
    return comparison


def median_half_width(probes: int, trials: int = 200) -> float:
    rng = np.random.default_rng(probes)
    return statistics.median(draw(rng, probes).half_width for _ in range(trials))


def exact(mean: float, sd: float, count: int) -> Moments:
    """Moments of `count` samples whose spread is exactly `sd` (what the projection reads)."""
    return Moments(count=count, mean=mean, squares=sd * sd * (count - 1))


def test_the_probes_it_asks_for_give_the_width_it_promises():
    rng = np.random.default_rng(11)
    thin = Comparison.of((exact(PROBE_MEAN_J, PROBE_SD_J, 6), exact(1.0, 0.0, 6)),
                         (exact(PLAN_MEAN_J, PLAN_SD_J, 6 * DEPLOYED_PER_PROBE), exact(1.0, 0.0, 42)))
    assert thin.probes_needed is not None and thin.probes_needed > 6
    text = thin.evidence()
    assert text == f"too few probes: 6, need {thin.probes_needed} for ±5%"
    # What the projection promises, on samples it never saw: within 20 % of the target at M
    # probes, clearly wider at M / 2.
    needed = thin.probes_needed
    assert median_half_width(needed) == pytest.approx(TARGET_HALF_WIDTH, rel=0.2)
    assert median_half_width(max(needed // 2, 2)) > 1.3 * TARGET_HALF_WIDTH
    # Enough probes: nothing to say.
    plenty = draw(rng, 4 * needed)
    assert plenty.half_width < TARGET_HALF_WIDTH and plenty.probes_needed is None and plenty.evidence() is None
    assert plenty.describe_with_evidence() == plenty.describe()


def test_a_few_close_probes_are_thin_evidence_whatever_their_interval():
    # Two probes that happen to agree make a narrow interval by luck: still too few.
    lucky = Comparison.of((Moments.of([100.0, 100.5]), Moments.of([1.0, 1.0])),
                          (Moments.of([80.0, 80.4, 79.8, 80.2]), Moments.of([1.0] * 4)))
    assert lucky.half_width < TARGET_HALF_WIDTH
    assert lucky.probes_needed == MIN_TRUSTED_PROBES
    text = lucky.describe_with_evidence()
    assert text.startswith(f"{100 * lucky.saving:.1f}% (no interval yet: too few probes: 2, need 5 for ±5%")
    assert "[" not in text  # its width would be a guess: not printed
    # one probe: the deployed iterations' spread stands in for the probes'
    one = Comparison.of((Moments.of([100.0]), Moments.of([1.0])),
                        (Moments.of([80.0, 95.0, 70.0, 88.0]), Moments.of([1.0] * 4)))
    assert one.saving_low is None and one.probes_needed > MIN_TRUSTED_PROBES
    assert "too few probes: 1, need " in one.describe_with_evidence()


@pytest.mark.parametrize("fraction, interval", [(0.01, 10), (0.25, 2), (1 / 8, 4), (0.05, 7)])
def test_the_schedule_says_how_many_deployed_iterations_the_probes_take(fraction, interval):
    schedule = ProbeSchedule(fraction, interval)
    walker = ProbeSchedule(fraction, interval)
    probes_at = [index for index in range(4000) if walker.is_probe(index, None)]
    assert len(probes_at) >= 12
    for count in range(1, 13):
        said = schedule.deployed_iterations_for(count)
        # the count-th probe has run by then, and not much earlier than that
        assert probes_at[count - 1] < said <= probes_at[count - 1] + max(schedule.period, 12)
    assert ProbeSchedule(0.0, interval).deployed_iterations_for(3) is None
