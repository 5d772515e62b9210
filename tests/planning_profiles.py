"""Shared by the planning tests: where the published profiles live, and small slices of them."""

from __future__ import annotations

from pathlib import Path

from perseus_ext.planning.profile import Profile

P_BLOCK_A100 = 83.64
_ROOT = Path(__file__).resolve().parents[1]
# The shipped profiles may live in the examples or in the package data; either works.
_PLACES = (_ROOT / "examples" / "profiles", _ROOT / "perseus_ext" / "data" / "profiles")


def profile_path(name: str) -> Path:
    """Path of a shipped profile by name, e.g. `gpt3-175b-a100_sxm`."""
    for place in _PLACES:
        for path in (place / f"{name}.csv", *place.glob(f"**/{name}.csv")):
            if path.is_file():
                return path
    raise FileNotFoundError(f"shipped profile {name}.csv in none of {', '.join(map(str, _PLACES))}")


def sub_profile(raw: Profile, stages: int, clocks: tuple[int, ...]) -> Profile:
    """The first `stages` stages of a published profile, measured at `clocks` only."""
    rows = [r for r in raw.rows() if r["stage"] < stages and r["frequency"] in clocks]
    return Profile.from_rows(rows, source=f"{raw.source}[{stages} stages, {clocks}]")
