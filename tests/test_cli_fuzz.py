"""Property-based tests of the CLI: any argument vector made of the options `frontier` and
`emulate` take, with values from a list of troublemakers, ends in exit 0 (success), 2 (usage or
input error, one line on stderr) or 1 (operating-system error), never in a traceback.

Problem sizes are tiny (a 2-stage, 3-clock profile), so every example runs in milliseconds."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from perseus_ext.cli import main
from perseus_ext.data import shipped_profile
from perseus_ext.planning.profile import Profile, load_profile

CLI_FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Every good vector runs the solver to the end (a quarter second each): fewer of them, over the
# same space of options (the bad vectors above are what the parsers are fuzzed with).
GOOD_VECTORS = settings(CLI_FUZZ, max_examples=30)

NUMBERS = st.sampled_from(["0", "1", "2", "3", "-1", "nan", "inf", "1e-9", "1e9", "4097", "x", "", "2.5", "83.64"])
SMALL = st.sampled_from(["1", "2", "3", "4"])
# Half the examples use a good profile and mostly good numbers, so they get to the solver.
PROFILES = st.one_of(st.just("{tiny}.csv"), st.sampled_from(
    ["{tiny}", "nope", "", "{dir}", "{binary}", "gpt3-175b-h100", "../x"]))
SIZES = st.one_of(SMALL, SMALL, SMALL, NUMBERS)
POWERS = st.sampled_from(["a100", "A40", "80", "0", "-5", "nan", "h100", "1e400"])
OUTPUTS = st.sampled_from(["{dir}/out.json", "{dir}/out.csv", "{dir}", "{dir}/missing/dir/out.csv", "{file}/x.json", ""])
PLOTS = st.sampled_from(["{dir}/p.txt", "{file}/p.png", "{dir}"])
VERBOSITY = st.sampled_from([[], ["-q"], ["-v"], ["-q", "-v"]])


def _option(name: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return values.map(lambda value: [name, value])


FRONTIER_OPTIONS = st.lists(st.one_of(
    _option("--stages", SIZES),
    _option("--microbatches", SIZES),
    _option("--blocking-power", POWERS),
    _option("--schedule", st.sampled_from(["1f1b", "interleaved", "gpipe"])),
    _option("--virtual-stages", SIZES),
    _option("--resolution", st.sampled_from(["0.001", "0.01", "0", "nan", "1e-12", "1e9"])),
    _option("--out", OUTPUTS),
    _option("--plot", PLOTS),
    st.just(["--bogus"]),
), max_size=4)

EMULATE_OPTIONS = st.lists(st.one_of(
    _option("--tp", SIZES),
    _option("--pp", SIZES),
    _option("--microbatches", SIZES),
    _option("--global-batch", SIZES),
    _option("--microbatch-size", SIZES),
    _option("--schedule", st.sampled_from(["1f1b", "interleaved"])),
    _option("--chunks", SIZES),
    _option("--blocking-power", POWERS),
    _option("--scale", NUMBERS),
    _option("--slowdown", st.sampled_from(["1.2", "1", "0.5", "nan", "1e9"])),
    _option("--slowdown-distribution", st.sampled_from(["1.0:0.9,1.2:0.1", "x", "1.2", "1.0:-1", ""])),
    _option("--slowdown-trace", st.sampled_from(["{binary}", "{tiny}", "nope", "{dir}"])),
    _option("--output", OUTPUTS),
    _option("--power-budget", st.sampled_from(["0.8", "1", "0", "1.5", "nan"])),
    st.just(["--markdown"]),
), max_size=4)


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-fuzz")
    raw = load_profile(shipped_profile("gpt3-175b-a40"))
    rows = [r for r in raw.rows() if r["stage"] < 2 and r["frequency"] in (1740, 1500, 1200)]
    tiny = root / "tiny-a40"
    Profile.from_rows(rows).save(tiny.with_suffix(".csv"))
    binary = root / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    a_file = root / "a-file"
    a_file.write_text("")
    return {"tiny": str(tiny), "binary": str(binary), "file": str(a_file)}


def _run(argv: list[str], places: dict[str, str], capsys) -> None:
    with tempfile.TemporaryDirectory() as directory:
        argv = [arg.format(dir=directory, **places) for arg in argv]
        package_level = logging.getLogger("perseus_ext").level
        try:
            code = main(argv)
        except SystemExit as done:  # argparse: usage errors and --help
            code = done.code
        finally:
            logging.getLogger("perseus_ext").setLevel(package_level)
    captured = capsys.readouterr()
    event(f"exit {code}")  # --hypothesis-show-statistics: how many examples got how far
    assert code in (0, 1, 2), (argv, code)
    assert "Traceback" not in captured.err
    if code != 0:
        assert "error" in captured.err, (argv, captured.err)


@CLI_FUZZ
@given(profile=PROFILES, options=FRONTIER_OPTIONS, verbosity=VERBOSITY)
def test_frontier_never_answers_with_a_traceback(profile, options, verbosity, places, capsys) -> None:
    argv = ["frontier", *verbosity, "--profile", profile, "--microbatches", "3"]
    _run(argv + [arg for option in options for arg in option], places, capsys)


@CLI_FUZZ
@given(profile=PROFILES, options=EMULATE_OPTIONS, verbosity=VERBOSITY)
def test_emulate_never_answers_with_a_traceback(profile, options, verbosity, places, capsys) -> None:
    argv = ["emulate", "--profile", profile, "--microbatches", "2", *verbosity]
    _run(argv + [arg for option in options for arg in option], places, capsys)


@GOOD_VECTORS
@given(
    microbatches=st.integers(1, 6),
    stages=st.sampled_from([[], ["--stages", "2"]]),
    power=st.sampled_from([[], ["--blocking-power", "a40"], ["--blocking-power", "70.5"]]),
    resolution=st.sampled_from([[], ["--resolution", "0.01"]]),
    verbosity=st.sampled_from([[], ["-q"], ["-v"]]),
)
def test_good_frontier_vectors_write_their_output(microbatches, stages, power, resolution, verbosity,
                                                  places, capsys) -> None:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "nested" / "frontier.json"
        argv = ["frontier", "--profile", places["tiny"] + ".csv", "--microbatches", str(microbatches),
                *stages, *power, *resolution, *verbosity, "--out", str(out)]
        try:
            assert main(argv) == 0, capsys.readouterr().err
        finally:
            logging.getLogger("perseus_ext").setLevel(logging.NOTSET)
        assert out.stat().st_size > 0
    assert "T_min" in capsys.readouterr().out
