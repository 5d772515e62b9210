"""Solver options are checked at the door, and absurd solves are refused before allocating."""

from __future__ import annotations

import math

import pytest
from planning_profiles import P_BLOCK_A100, profile_path

from perseus_ext.errors import SolverError
from perseus_ext.planning.options import BOUNDS, estimate_cost
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_grid_points", -5),
        ("min_grid_points", 0),
        ("resolution", math.nan),
        ("resolution", 1e-12),
        ("resolution", -1.0),
        ("anchors", 1),
        ("anchors", 2.5),
        ("grid_oversampling", True),
        ("max_memory_gib", math.inf),
        ("progress", 1),
    ],
)
def test_bad_option_names_the_field(field: str, value) -> None:
    with pytest.raises(SolverError, match=f"solver option {field} must be"):
        SolverOptions(**{field: value})


def test_defaults_lie_within_the_bounds() -> None:
    options = SolverOptions()
    for field, (low, high) in BOUNDS.items():
        assert low <= getattr(options, field) <= high


def test_too_many_microbatches_are_refused_before_planning() -> None:
    profile = load_profile(profile_path("gpt3-175b-a100_sxm"))
    with pytest.raises(SolverError, match="fewer microbatches"):
        solve_frontier(one_f_one_b(2, 20_000), profile, P_BLOCK_A100, SolverOptions(max_memory_gib=0.1))


def test_profile_in_milliseconds_is_refused_with_the_fix() -> None:
    in_ms = load_profile(profile_path("gpt3-175b-a100_sxm")).scaled(time_factor=1000.0)
    with pytest.raises(SolverError, match=r"raise solver option resolution to at least .*\(milliseconds"):
        solve_frontier(one_f_one_b(8, 96), in_ms, P_BLOCK_A100)


def test_estimate_grows_with_the_problem() -> None:
    small, large = estimate_cost(384, 600, 155), estimate_cost(1536, 2300, 164)
    assert large[0] > small[0] and large[1] > small[1]
    # Calibration check: 8 x 96 (grid bound ~3,500) measured ~280 MiB peak and ~3.2 s of CPU.
    at_8x96 = estimate_cost(1536, 3535, 164)
    assert 0.2 * 2**30 < at_8x96[0] < 0.6 * 2**30
    assert 2.0 < at_8x96[1] < 6.0
