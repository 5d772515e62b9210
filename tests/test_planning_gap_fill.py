"""The solver's gap fill (`fill_gaps`), against a plain Python reading of its contract.

It picks the frontier the stretch rounds work from: the Pareto plans plus, inside every gap
wider than the resolution between two of them, the cheapest candidate of each half-resolution
bin, in order of time, then energy, then index (ties are common: the same plan is found at
several deadlines).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from perseus_ext.planning.pool import FILL_BIN, fill_gaps, pareto


def expected_fill(times: np.ndarray, energies: np.ndarray, keep: list[int], resolution: float) -> list[int]:
    bin_width = resolution * FILL_BIN
    chosen = set(keep)
    for a, b in zip(times[keep][:-1], times[keep][1:]):
        if b - a <= 2 * bin_width:
            continue
        cheapest: dict[int, int] = {}
        for j in range(len(times)):
            if a < times[j] < b:
                key = math.floor((times[j] - a) / bin_width)
                if key not in cheapest or (energies[j], j) < (energies[cheapest[key]], cheapest[key]):
                    cheapest[key] = j
        chosen |= set(cheapest.values())
    return sorted(chosen, key=lambda j: (times[j], energies[j], j))


@pytest.mark.parametrize("seed", range(8))
def test_the_fill_is_the_pareto_plans_and_each_bins_cheapest_in_time_energy_index_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    # Times on a coarse grid and energies from a few values: many exact ties, as in a pool.
    times = 4.0 + rng.integers(0, 60, n) * 2.5e-4
    energies = 1000.0 + rng.integers(0, 12, n) * 0.5
    keep = pareto(times, energies)
    got = fill_gaps(times, energies, keep, 1e-3)
    assert got.tolist() == expected_fill(times, energies, keep, 1e-3)


def test_a_frontier_without_gaps_is_its_pareto_plans() -> None:
    times = np.array([1.0, 1.0005, 1.001, 1.0008])
    energies = np.array([5.0, 4.0, 3.0, 4.5])
    keep = pareto(times, energies)
    assert fill_gaps(times, energies, keep, 1e-3).tolist() == keep == [0, 1, 2]
