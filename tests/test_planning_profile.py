"""Profile CSV loading, validation errors and Pareto filtering."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from perseus_ext.data import shipped_profile, shipped_profile_names
from perseus_ext.errors import ProfileError
from perseus_ext.planning.profile import MAX_PROFILE_BYTES, Profile, load_profile

GOOD = """stage,instruction,frequency,time,energy
0,forward,1410,0.05,24
0,forward,1200,0.06,20
0,backward,1410,0.10,48
0,backward,1200,0.12,40
1,forward,1410,0.05,24
1,forward,1200,0.06,20
1,backward,1410,0.10,48
1,backward,1200,0.12,40
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", shipped_profile_names())
def test_shipped_profiles_load(name: str) -> None:
    measured = load_profile(shipped_profile(name))
    assert measured.num_stages == 8
    assert all(np.all(np.diff(op.frequencies) < 0) for op in measured.points.values())
    power = 70.38 if name.endswith("a40") else 83.64
    for op in measured.useful_clocks(power).points.values():
        # Useful clocks: faster ones cost more in energy - blocking power x time, slower ones less.
        assert np.all(np.diff(op.times) > 0)
        assert np.all(np.diff(op.energies - power * op.times) < 0)
        assert np.all(np.diff(op.frequencies) < 0)


def test_good_profile_round_trips(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, GOOD))
    assert profile.num_stages == 2
    assert profile[1, "backward"].frequencies.tolist() == [1410, 1200]
    out = tmp_path / "saved.csv"
    profile.save(out)
    again = load_profile(out)
    assert again.rows() == profile.rows()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.replace("stage,", "stages,"), r"row 1: unknown column\(s\) \['stages'\]"),
        (lambda t: t.replace(",energy", ",energy,extra"), r"unknown column\(s\) \['extra'\]"),
        (lambda t: t.replace(",energy", ",energy,time"), r"row 1: column\(s\) \['time'\] appear more than once"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,0.05,24,7"), r"row 2: 6 field\(s\) but the header has 5"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410"), r"row 2: 3 field\(s\) but the header has 5"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1000000000000000000000000000000,0.05,24"),
         r"row 2: field 'frequency' is 10+; it must be between 1 and 10000 \(an SM clock in MHz\)"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1e30,0.05,24"), r"row 2: field 'frequency' is '1e30'; it must be an integer"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,500,24"), r"row 2: field 'time' is 500 seconds.*milliseconds\? divide by 1000"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,0.05,24000"), r"row 2: energy 24000 J in 0.05 s is 480,000 W.*millijoules"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,0.05,inf"), r"row 2: field 'energy' is 'inf'; it must be a finite positive"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "1000000000,forward,1410,0.05,24"), r"row 2: field 'stage' is 1000000000; it must be between 0 and 511"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward," + "1" * 100 + ",0.05,24"), r"row 2: a field of 100 characters"),
        (lambda t: t.replace("1,backward,1200,0.12,40", "1,backwrd,1200,0.12,40"),
         r"row 9: field 'instruction' is 'backwrd' \(did you mean 'backward'\?\); use one of 'forward', 'backward'"),
        (lambda t: t.replace("0,forward,1410,0.05,24", 'x,"forward\n1410'), r"row 2: a quoted field spans several lines"),
        (lambda t: "", r"empty; the first row must be the header"),
        (lambda t: t.splitlines()[0] + "\n\n", r"no measurements after the header"),
        (lambda t: t.replace("0,forward,1200,0.06,20\n", "\n\n0,forward,1200,-1,20\n"), r"row 5: field 'time' is '-1'"),
        (lambda t: t.replace("time,energy", "time"), r"missing column\(s\) \['energy'\]"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,nan,24"), r"row 2: field 'time' is 'nan'"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,-0.05,24"), r"row 2: field 'time'.*positive"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,0,24"), r"row 2: field 'time'.*positive"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,forward,1410,0.05,abc"), r"row 2: field 'energy' is 'abc'"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "x,forward,1410,0.05,24"), r"row 2: field 'stage' is 'x'"),
        (lambda t: t.replace("0,forward,1410,0.05,24", "0,,1410,0.05,24"), r"row 2: field 'instruction' is empty"),
        (lambda t: t + "0,forward,1410,0.05,24\n", r"row 10: duplicate of row 2"),
        (lambda t: t.replace("1,backward,1410,0.10,48\n1,backward,1200,0.12,40\n", ""), r"stage 1 has no 'backward'"),
        (lambda t: t.replace("0,backward,1200,0.12,40\n", ""), r"stage 0 instruction 'backward' lacks clock\(s\) \[1200\]"),
        (lambda t: t.replace("0,", "2,"), r"stage 0 has no"),
    ],
)
def test_bad_profiles_name_file_row_and_field(tmp_path: Path, mutate, message: str) -> None:
    path = write(tmp_path, mutate(GOOD))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.csv")
    with pytest.raises(ProfileError, match="not a regular file"):
        load_profile(tmp_path)


@pytest.mark.parametrize(
    "data, message",
    [
        (GOOD.encode().replace(b"forward", b"forw\xe4rd", 1), r"row 2: byte 0xe4 is not UTF-8 text"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"binary data \(NUL bytes\)"),
        (GOOD.encode("utf-16"), r"binary data|not UTF-8"),
    ],
)
def test_non_text_files_are_refused(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "profile.csv"
    path.write_bytes(data)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_a_byte_order_mark_and_crlf_lines_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.replace("\n", "\r\n").encode())
    assert load_profile(path).rows() == load_profile(write(tmp_path, GOOD)).rows()


def test_oversized_files_are_refused_without_reading_them(tmp_path: Path) -> None:
    huge = tmp_path / "huge.csv"
    with open(huge, "wb") as fh:
        fh.truncate(64 * 1024 ** 3)  # sparse: 64 GiB on paper, nothing on disk
    tracemalloc.start()
    try:
        with pytest.raises(ProfileError, match=r"huge.csv: larger than 16 MiB"):
            load_profile(huge)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 2 * MAX_PROFILE_BYTES


def test_useful_clocks_drop_noise_keep_what_waiting_pays_for_and_log_it(caplog: pytest.LogCaptureFixture) -> None:
    rows = [
        # 1300 MHz measured faster than 1410 (noise): 1410 is never useful.
        {"stage": 0, "instruction": "forward", "frequency": 1410, "time": 0.051, "energy": 24},
        {"stage": 0, "instruction": "forward", "frequency": 1300, "time": 0.050, "energy": 22},
        {"stage": 0, "instruction": "forward", "frequency": 1100, "time": 0.060, "energy": 18},
        # Below the minimum-energy clock energy rises again (+1 J in 10 ms): 900 is useful only
        # where blocking power over 100 W is paid for the time it saves.
        {"stage": 0, "instruction": "forward", "frequency": 900, "time": 0.070, "energy": 19},
        {"stage": 0, "instruction": "backward", "frequency": 1410, "time": 0.1, "energy": 40},
        {"stage": 0, "instruction": "backward", "frequency": 1300, "time": 0.11, "energy": 38},
        {"stage": 0, "instruction": "backward", "frequency": 1100, "time": 0.12, "energy": 36},
        {"stage": 0, "instruction": "backward", "frequency": 900, "time": 0.13, "energy": 35},
    ]
    measured = Profile.from_rows(rows, source="noisy")
    with caplog.at_level(logging.DEBUG, logger="perseus_ext.planning.profile"):
        profile = measured.useful_clocks(50.0)
    assert profile[0, "forward"].frequencies.tolist() == [1300, 1100]
    assert profile[0, "backward"].frequencies.tolist() == [1410, 1300, 1100, 900]
    assert sorted(profile.dropped) == [(0, "forward", 900), (0, "forward", 1410)]
    per_clock = [r for r in caplog.records if r.levelno == logging.DEBUG]
    summary = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in per_clock] == ["noisy: stage 0 forward: dropped 2 clock(s) [1410, 900]"]
    assert len(summary) == 1 and "6 of 8 clock measurements useful at blocking power 50 W; dropped 2" in summary[0].getMessage()
    assert measured.useful_clocks(150.0)[0, "forward"].frequencies.tolist() == [1300, 1100, 900]
    with pytest.raises(ProfileError, match="blocking power"):
        measured.useful_clocks(-1.0)


def test_scaling_multiplies_time_and_energy(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, GOOD)).scaled(10, 80)
    op = profile[0, "forward"]
    assert op.times.tolist() == pytest.approx([0.5, 0.6])
    assert op.energies.tolist() == pytest.approx([1920, 1600])
    with pytest.raises(ProfileError):
        profile.scaled(0, 1)
