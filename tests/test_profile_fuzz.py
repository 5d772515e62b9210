"""Property-based tests of the profile reader: whatever the file holds, the answer is a valid
Profile or a ProfileError naming the file, never another exception or an unbounded allocation."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus_ext.errors import ProfileError
from perseus_ext.planning.profile import (
    COLUMNS,
    MAX_CLOCK_MHZ,
    MAX_STAGES,
    MAX_TIME_S,
    Profile,
    load_profile,
)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# Field values that have broken CSV readers: numbers at and beyond every bound, non-numbers,
# typos, quoting and separators inside fields, non-ASCII text.
TOKENS = st.sampled_from([
    "0", "1", "2", "7", "-1", "1410", "1200", "0.05", "0.1", "24", "48", "1e30", "1e-30", "nan",
    "inf", "-inf", "NaN", "10" * 20, "1" * 70, "", " ", "forward", "backward", "forwrd", "Forward",
    "x", "é", "\u202e", '"', '""', "a,b", "1_000", "0x10", "1e400", str(MAX_CLOCK_MHZ + 1),
    str(MAX_STAGES), str(MAX_TIME_S * 2), "\t", "\\", "None",
])
HEADERS = st.one_of(
    st.just(list(COLUMNS)),
    st.permutations(list(COLUMNS)),
    st.lists(st.sampled_from(list(COLUMNS) + ["extra", "", "Stage"]), max_size=8),
)


def _load(data: bytes) -> Profile | None:
    """Load `data` as a profile file; a ProfileError must name the file."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.csv"
        path.write_bytes(data)
        try:
            return load_profile(path)
        except ProfileError as err:
            assert str(path) in str(err)
            return None


def _check_valid(profile: Profile) -> None:
    for (stage, instruction), op in profile.points.items():
        assert 0 <= stage < MAX_STAGES and instruction in ("forward", "backward")
        assert np.all((op.frequencies >= 1) & (op.frequencies <= MAX_CLOCK_MHZ))
        assert np.all(np.isfinite(op.times) & (op.times > 0) & (op.times <= MAX_TIME_S))
        assert np.all(np.isfinite(op.energies) & (op.energies > 0))


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes_give_a_profile_or_a_profile_error(data: bytes) -> None:
    profile = _load(data)
    if profile is not None:
        _check_valid(profile)


@FUZZ
@given(
    header=HEADERS,
    rows=st.lists(st.one_of(st.lists(TOKENS, min_size=5, max_size=5), st.lists(TOKENS, max_size=7)),
                  max_size=12),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    bom=st.booleans(),
    encoding=st.sampled_from(["utf-8", "latin-1", "utf-16"]),
)
def test_csv_shaped_garbage_gives_a_profile_or_a_profile_error(header, rows, newline, bom, encoding) -> None:
    text = newline.join(",".join(fields) for fields in [header, *rows]) + newline
    data = text.encode(encoding, errors="replace")
    profile = _load((b"\xef\xbb\xbf" if bom else b"") + data)
    if profile is not None:
        _check_valid(profile)


@st.composite
def valid_profiles(draw) -> list[dict[str, object]]:
    stages = draw(st.integers(1, 4))
    clocks = draw(st.lists(st.integers(100, 3000), min_size=1, max_size=6, unique=True))
    seconds = st.floats(1e-4, 10.0, allow_nan=False, allow_infinity=False)
    watts = st.floats(1.0, 5000.0, allow_nan=False, allow_infinity=False)
    rows = []
    for stage in range(stages):
        for instruction in ("forward", "backward"):
            for clock in clocks:
                time = draw(seconds)
                rows.append({"stage": stage, "instruction": instruction, "frequency": clock,
                             "time": time, "energy": time * draw(watts)})
    return rows


@FUZZ
@given(rows=valid_profiles())
def test_valid_profiles_round_trip_and_useful_clock_filter(rows) -> None:
    profile = Profile.from_rows(rows, source="generated")
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "p.csv"
        profile.save(path)
        again = load_profile(path)
    assert again.rows() == profile.rows()
    for power in (0.0, 83.64):
        filtered = profile.useful_clocks(power)
        for key, op in filtered.points.items():
            waiting = op.energies - power * op.times
            assert np.all(np.diff(op.times) > 0) and np.all(np.diff(waiting) < 0)
            original = profile.points[key]
            # Every dropped clock is beaten on both time and energy - P_block x time by a kept one.
            for f, t, e in zip(original.frequencies, original.times, original.energies):
                if f not in op.frequencies:
                    assert any(kt <= t and kw <= e - power * t for kt, kw in zip(op.times, waiting))
    assert all(math.isfinite(r["time"]) for r in filtered.rows())


def test_a_dominated_clock_is_dropped_for_a_kept_clock_that_beats_it() -> None:
    """The fuzzed claim above only bites when a clock is dropped: one case where it must be."""
    rows = [{"stage": 0, "instruction": kind, "frequency": clock, "time": time, "energy": energy}
            for kind in ("forward", "backward")
            for clock, time, energy in ((1000, 1.0, 300.0), (1500, 0.5, 200.0), (2000, 0.4, 240.0))]
    profile = Profile.from_rows(rows, source="hand-written")
    for key, op in profile.useful_clocks(83.64).points.items():
        assert [int(f) for f in op.frequencies] == [2000, 1500], key  # 1000 MHz: slower and dearer than 1500
