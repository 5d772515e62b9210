"""Profiles with every computation kind, the rule that estimates the kinds a forward/backward
profile lacks, and the emulator on schedules that run them."""

from __future__ import annotations

from functools import partial

import string

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.emulator import Emulator, JobLayout, StragglerScenario
from perseus_ext.errors import ProfileError
from perseus_ext.planning.derived import DerivationRule, derive_kinds
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.profile import INSTRUCTIONS, Profile, load_profile
from perseus_ext.planning.schedule import Kind, combined_1f1b
from perseus_ext.planning.solver import solve_frontier
from tests.planning_profiles import P_BLOCK_A100, profile_path, sub_profile


@pytest.fixture(scope="module")
def raw() -> Profile:
    return load_profile(profile_path("gpt3-175b-a100_sxm"))


def test_profile_instructions_are_the_computation_kinds() -> None:
    assert set(INSTRUCTIONS) == {kind.value for kind in Kind}


def _rows(instructions: list[str]) -> list[dict]:
    return [{"stage": 0, "instruction": name, "frequency": f, "time": 0.01 * (2000 - f) / 500, "energy": 3.0}
            for name in instructions for f in (1410, 1200)]


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(INSTRUCTIONS[2:]), max_size=4))
def test_every_kind_is_read_back(extra: set[str]) -> None:
    profile = Profile.from_rows(_rows(["forward", "backward", *sorted(extra)]))
    assert set(profile.instructions) == {"forward", "backward", *extra}


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=string.ascii_letters + "_- ", min_size=1, max_size=20))
def test_other_instructions_are_refused_naming_the_kinds(name: str) -> None:
    if name.strip() in INSTRUCTIONS:
        name = name.strip() + "x"
    with pytest.raises(ProfileError, match=r"field 'instruction' is .*use one of 'forward', 'backward', "
                                           r"'input_gradient', 'weight_gradient', 'combined', 'reduce_grad'"):
        Profile.from_rows(_rows(["forward", "backward", name]))


def test_split_gradient_profiles_need_no_backward() -> None:
    profile = Profile.from_rows(_rows(["forward", "input_gradient", "weight_gradient"]))
    assert profile.instructions == ["forward", "input_gradient", "weight_gradient"]
    with pytest.raises(ProfileError, match="stage 0 has no 'backward' rows"):
        Profile.from_rows(_rows(["forward", "input_gradient"]))
    rows = _rows(["forward", "backward", "combined"])[:-1]  # combined lacks 1200 MHz
    with pytest.raises(ProfileError, match="'combined' lacks clock"):
        Profile.from_rows(rows)


def test_derivation_rule_figures(raw: Profile) -> None:
    rule = DerivationRule(input_gradient_share=0.4, overlap_share=0.5)
    profile = derive_kinds(sub_profile(raw, 2, (1410, 1200, 990)), rule)
    for stage in range(2):
        f, b = profile[stage, "forward"], profile[stage, "backward"]
        i, w, c = profile[stage, "input_gradient"], profile[stage, "weight_gradient"], profile[stage, "combined"]
        np.testing.assert_allclose(i.times, 0.4 * b.times, rtol=1e-15)
        np.testing.assert_allclose(w.energies, 0.6 * b.energies, rtol=1e-15)
        np.testing.assert_allclose(i.times + w.times, b.times, rtol=1e-15)
        np.testing.assert_allclose(c.times, f.times + b.times - 0.5 * np.minimum(f.times, b.times), rtol=1e-15)
        np.testing.assert_allclose(c.energies, f.energies + b.energies, rtol=1e-15)
        assert c.frequencies.tolist() == f.frequencies.tolist()


def test_measured_rows_win_over_the_rule(raw: Profile) -> None:
    base = sub_profile(raw, 1, (1410, 1200))
    rows = base.rows() + [dict(r, instruction="combined", time=r["time"] * 2.5) for r in base.rows()
                          if r["instruction"] == "forward"]
    profile = derive_kinds(Profile.from_rows(rows))
    np.testing.assert_array_equal(profile[0, "combined"].times, 2.5 * profile[0, "forward"].times)


@pytest.mark.parametrize("field, value", [("input_gradient_share", 0.0), ("input_gradient_share", 1.0),
                                          ("overlap_share", -0.1), ("overlap_share", 1.5),
                                          ("overlap_share", float("nan"))])
def test_bad_rules_are_refused_by_field(field: str, value: float) -> None:
    with pytest.raises(ProfileError, match=field):
        DerivationRule(**{field: value})


def test_a_missing_kind_names_the_rule(raw: Profile) -> None:
    with pytest.raises(ProfileError, match="instruction 'combined'.*derive_kinds"):
        CostModel(combined_1f1b(2, 4, 2), sub_profile(raw, 2, (1410, 1200)), P_BLOCK_A100)


def test_emulator_runs_combined_1f1b_from_a_forward_backward_profile(raw: Profile) -> None:
    profile = sub_profile(raw, 4, tuple(range(1410, 1000, -60)))
    results = {}
    for schedule, overlap in (("interleaved", 0.0), ("combined_1f1b", 0.0), ("combined_1f1b", 0.5)):
        layout = JobLayout(tensor_parallel=1, pipeline_parallel=4, global_batch=16, microbatches=8,
                           schedule=schedule, chunks=2)
        # No clock-change budget: this checks the combined units' derivation, not the budget (whose
        # cost on a profiled slice has its own tests and table).
        emulator = Emulator(profile, layout, P_BLOCK_A100, derivation=DerivationRule(overlap_share=overlap),
                            solver=partial(solve_frontier, options=SolverOptions(max_clock_changes_per_s=0)))
        emulation = emulator.run(StragglerScenario.none())
        assert emulator.derived_kinds == (() if schedule == "interleaved" else ("combined",))
        assert emulation.intrinsic_saving > 0
        results[schedule, overlap] = emulator.max_clock_plan.time
    # Overlap shortens every combined unit, so the all-max-clock iteration gets shorter.
    assert results["combined_1f1b", 0.5] < results["combined_1f1b", 0.0]
