"""CLI consistency: shared profile/blocking-power forms, -q/-v anywhere, help on every option,
range-checked numbers, outputs checked before solving, no progress bar off a terminal,
`doctor` and `patch-path`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from perseus_ext.cli import build_parser, main
from perseus_ext.data import patches_dir, shipped_profile, shipped_profile_names
from perseus_ext.planning.profile import Profile, load_profile


@pytest.fixture()
def tiny_profile(tmp_path: Path) -> Path:
    """2 stages x 3 clocks, sliced from the published A100 profile (names no GPU)."""
    raw = load_profile(shipped_profile("gpt3-175b-a100_sxm"))
    rows = [r for r in raw.rows() if r["stage"] < 2 and r["frequency"] in (1410, 1200, 1005)]
    path = tmp_path / "tiny.csv"
    Profile.from_rows(rows).save(path)
    return path


@pytest.fixture(autouse=True)
def restore_log_level():
    package = logging.getLogger("perseus_ext")
    level = package.level
    yield
    package.setLevel(level)


@pytest.fixture()
def no_solve(monkeypatch):
    """Fail the test if the frontier solver is reached."""
    import perseus_ext.planning.solver as solver

    def forbidden(*args, **kwargs):
        raise AssertionError("the solver ran although an argument was bad")

    monkeypatch.setattr(solver, "solve_frontier", forbidden)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help() -> None:
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in _subparsers().items()
        for action in parser._actions
        if not action.help
    ]
    assert missing == []
    assert {"frontier", "emulate", "doctor", "patch-path"} <= set(_subparsers())


@pytest.mark.parametrize("flag, level", [("-q", logging.WARNING), ("-v", logging.DEBUG), (None, logging.INFO)])
def test_verbosity_works_after_the_subcommand(flag, level, caplog, tmp_path) -> None:
    caplog.set_level(logging.DEBUG)
    noisy = tmp_path / "noisy-a100.csv"  # 1410 MHz measured slower than 1200: dominated
    noisy.write_text(
        "stage,instruction,frequency,time,energy\n"
        "0,forward,1410,0.06,30\n0,forward,1200,0.05,20\n0,backward,1410,0.1,40\n0,backward,1200,0.12,30\n"
    )
    argv = ["frontier", "--profile", str(noisy), "--microbatches", "2"] + ([flag] if flag else [])
    assert main(argv) == 0
    assert logging.getLogger("perseus_ext").level == level
    emitted = [r for r in caplog.records if r.name == "perseus_ext.planning.profile"
               and logging.getLogger("perseus_ext").isEnabledFor(r.levelno)]
    per_clock = [r for r in emitted if "stage 0 forward: dropped 1 clock(s) [1410]" in r.getMessage()]
    assert [r.levelno for r in per_clock] == ([logging.DEBUG] if level == logging.DEBUG else [])
    # The one-line summary is INFO: shown by default and with -v, not with -q.
    assert any("3 of 4 clock measurements useful" in r.getMessage() for r in emitted) is (level != logging.WARNING)


def test_frontier_and_emulate_take_the_same_profile_names_and_blocking_power(tmp_path, capsys) -> None:
    out = tmp_path / "f.json"
    assert main(["frontier", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "8",
                 "--blocking-power", "a100", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["blocking_power"] == 83.64
    assert main(["frontier", "--profile", "gpt3-175b-a100_sxm.csv", "--microbatches", "8",
                 "--blocking-power", "80.5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["blocking_power"] == 80.5
    records = tmp_path / "e.json"
    for power in (None, "a100", "83.64"):
        argv = ["emulate", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "8", "--output", str(records)]
        assert main(argv + (["--blocking-power", power] if power else [])) == 0
        assert "blocking power 83.64 W/GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["frontier", "--microbatches", "4", "--stages", "0"], "--stages: 0 is out of range"),
        (["frontier", "--microbatches", "0"], "--microbatches: 0 is out of range"),
        (["frontier", "--microbatches", "1000000000"], "--microbatches: 1000000000 is out of range"),
        (["frontier", "--microbatches", "4", "--resolution", "nan"], "--resolution: nan is out of range"),
        (["frontier", "--microbatches", "4", "--resolution", "1e-12"], "--resolution: 1e-12 is out of range"),
        (["frontier", "--microbatches", "4", "--virtual-stages", "x"], "'x' is not an integer"),
        (["emulate", "--microbatches", "4", "--pp", "0"], "--pp: 0 is out of range"),
        (["emulate", "--microbatches", "4", "--scale", "inf"], "--scale: inf is out of range"),
        (["emulate", "--microbatches", "4", "--slowdown", "0.5"], "--slowdown: 0.5 is out of range"),
        (["doctor", "--updates", "1"], "--updates: 1 is out of range"),
    ],
)
def test_bad_numbers_are_usage_errors(argv, message, tiny_profile, capsys) -> None:
    if argv[0] != "doctor":
        argv = argv + ["--profile", str(tiny_profile), "--blocking-power", "80"]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["frontier", "emulate"])
def test_oversized_pipeline_fails_before_solving(command, no_solve, capsys) -> None:
    argv = [command, "--profile", "gpt3-175b-a100_sxm", "--microbatches", "1024"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    stages, chunks = ("--stages", "--virtual-stages") if command == "frontier" else ("--pp", "--chunks")
    # The refusal names the flags that set the size and the largest --microbatches that fits.
    assert f"{stages} 8 x --microbatches 1024 x {chunks} 1 is 16,384 computations" in error
    assert f"lower --microbatches (at most 768 here) or {chunks}" in error


@pytest.mark.parametrize(
    "option, make_path, message",
    [
        ("--out", lambda tmp: tmp / "a-file" / "frontier.json", "cannot write there"),
        ("--out", lambda tmp: tmp, "is a directory"),
        ("--plot", lambda tmp: tmp / "frontier.txt", "use a file name ending in .png, .svg, .pdf"),
        ("--plot", lambda tmp: tmp / "a-file" / "frontier.png", "cannot write there"),
    ],
)
def test_unwritable_outputs_fail_before_solving(option, make_path, message, tmp_path, no_solve, capsys) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    argv = ["frontier", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "4", option, str(make_path(tmp_path))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {option}" in err and message in err and "Traceback" not in err


def test_emulate_checks_outputs_before_emulating(tmp_path, monkeypatch, capsys) -> None:
    import perseus_ext.emulator as emulator

    monkeypatch.setattr(emulator, "Emulator", None)  # any use would raise TypeError
    (tmp_path / "a-file").write_text("")
    for option in ("--output", "--plot-dir"):
        argv = ["emulate", "--profile", "gpt3-175b-a40", "--microbatches", "8",
                option, str(tmp_path / "a-file" / "x")]
        assert main(argv) == 2
        assert f"error: {option}" in capsys.readouterr().err


def test_check_leaves_no_file_behind_and_keeps_existing_ones(tmp_path) -> None:
    from perseus_ext.commands.arguments import check_writable_file

    check_writable_file(tmp_path / "new" / "f.json", "--out")
    assert not (tmp_path / "new" / "f.json").exists()
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    check_writable_file(existing, "--out")
    assert existing.read_text() == "keep"


def test_progress_bar_only_on_a_terminal(monkeypatch, tmp_path) -> None:
    import perseus_ext.planning.solver as solver

    seen = []
    real = solver.solve_frontier

    def spy(schedule, profile, power, options, **kwargs):
        seen.append(options.progress)
        return real(schedule, profile, power, options, **kwargs)

    monkeypatch.setattr(solver, "solve_frontier", spy)
    argv = ["frontier", "--profile", "gpt3-175b-a40", "--microbatches", "8", "-q"]
    assert main(argv) == 0  # pytest's stderr is not a terminal
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(argv) == 0
    assert seen == [False, True]


def test_unknown_profile_lists_the_shipped_ones(capsys) -> None:
    assert main(["emulate", "--profile", "gpt3-175b-h100", "--microbatches", "8"]) == 2
    err = capsys.readouterr().err
    assert "no such file, nor a shipped profile" in err
    assert all(name in err for name in shipped_profile_names())


def test_shipped_data_is_found_through_the_package() -> None:
    assert shipped_profile_names() == ["bloom-a100_sxm", "bloom-a40", "gpt3-175b-a100_sxm", "gpt3-175b-a40"]
    assert shipped_profile("../../setup") is None  # names only, never paths
    repository = Path(__file__).resolve().parents[1] / "patches" / "megatron-lm"
    shipped = sorted(p.name for p in (patches_dir() / "megatron-lm").glob("*.patch"))
    assert shipped == sorted(p.name for p in repository.glob("*.patch")) and len(shipped) >= 3


def test_patch_path_prints_the_patch_directory(capsys) -> None:
    assert main(["patch-path"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert (printed / "README.md").is_file() and printed == patches_dir() / "megatron-lm"
