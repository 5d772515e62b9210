"""`perseus-ext report`'s inputs: JSONL logs and frontier files, whatever a user feeds it.

Every bad file is one error line naming the file, the line and the field, never a traceback;
logs of two jobs or a rank given twice are refused, never merged; reading is streamed."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus_ext.cli import main
from perseus_ext.errors import PerseusError
from perseus_ext.inputs import InputError
from perseus_ext.planning.frontier import Frontier
from perseus_ext.observability.reporting import analyse, read_logs

ROW = {"timestamp": 1.0, "job": "a1b2", "iteration": 0, "rank": 0, "pipeline": 0, "stage": 0, "phase": "deployed",
       "plan": 0, "factor": 1.0, "fell_back": False, "probe": False, "time_s": 1.0, "compute_s": 0.9,
       "energy_j": 80.0, "coverage": 0.9}


def rows(rank: int, count: int, job: str = "a1b2", start: int = 0) -> list[dict]:
    return [{**ROW, "job": job, "rank": rank, "stage": rank, "iteration": i, "probe": i % 5 == 0,
             "energy_j": 100.0 + (i % 3) if i % 5 == 0 else 80.0 + (i % 2)} for i in range(start, start + count)]


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def report_error(capsys, *paths: str, extra: tuple[str, ...] = ()) -> str:
    assert main(["report", *paths, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("content, expected", [
    (b"\x00\x9f\x92\x96binary\n", "log-0.jsonl:1: the perseus-ext log is not UTF-8 text"),
    (json.dumps(ROW).encode() + b"\n" + "{\"caf\xe9\": 1}\n".encode("latin-1"), "log-0.jsonl:2: the perseus-ext log is not UTF-8"),
    (json.dumps({**ROW, "time_s": "1.0"}).encode(), "log-0.jsonl:1: time_s: Input should be a valid number"),
    (json.dumps({**ROW, "rank": 1e400}).encode().replace(b"Infinity", b"1e400"), "log-0.jsonl:1:"),
    (json.dumps({**ROW, "iteration": 10 ** 30}).encode(), "log-0.jsonl:1: iteration:"),
    (b'{"rank": ' + b"[" * 5000 + b"]" * 5000 + b"}", "log-0.jsonl:1:"),
    (json.dumps({**ROW, "energy_j": -3.0}).encode(), "log-0.jsonl:1: energy_j: Input should be greater than or equal to 0"),
    (json.dumps({**ROW, "time_s": 1e300}).encode(), "log-0.jsonl:1: time_s:"),
    (json.dumps({**ROW, "phase": "lunch"}).encode(), "log-0.jsonl:1: phase:"),
    (b'{"iteration": 0, "rank": 0, "phase": "deployed", "time_s": NaN}', "log-0.jsonl:1:"),
    (b"[1, 2]", "log-0.jsonl:1:"),
    (b"x" * 70_000, "log-0.jsonl:1: the line is longer than 65536 bytes"),
    (b"", "the logs hold no iteration records"),
])
def test_a_bad_log_is_one_line_naming_the_file_and_line(tmp_path, capsys, content, expected):
    path = tmp_path / "log-0.jsonl"
    path.write_bytes(content)
    err = report_error(capsys, str(path))
    assert expected in err and "perseus.log_path" in err


def test_a_directory_without_logs_or_a_missing_log_is_named(tmp_path, capsys):
    (tmp_path / "summary-0.json").write_text("{}")  # a folder is read as its *.jsonl files: none here
    assert f"{tmp_path}: the folder holds no .jsonl file" in report_error(capsys, str(tmp_path))
    assert "missing.jsonl: cannot read the perseus-ext log: No such file" in report_error(
        capsys, str(tmp_path / "missing.jsonl"))


def test_logs_of_two_jobs_are_refused_and_one_can_be_chosen(tmp_path, capsys):
    first = write(tmp_path / "log-0.jsonl", rows(0, 20, job="aaaa"))
    second = write(tmp_path / "log-1.jsonl", rows(1, 20, job="bbbb"))
    err = report_error(capsys, first, second)
    assert "2 different jobs (job aaaa in" in err and "--job (aaaa, bbbb)" in err
    assert main(["report", first, second, "--job", "bbbb"]) == 0
    assert capsys.readouterr().out.startswith("job bbbb: 1 rank, 20 iterations")


def test_a_rank_given_twice_is_refused(tmp_path, capsys):
    first = write(tmp_path / "log-0.jsonl", rows(0, 20))
    copy = write(tmp_path / "copy.jsonl", rows(0, 20))
    assert "rank 0 of job a1b2 is also in" in report_error(capsys, first, copy)
    twice = write(tmp_path / "twice.jsonl", rows(0, 10) + rows(0, 10, start=5))  # two writers, one rank
    assert "twice.jsonl:11: iteration: iteration 5 of rank 0 of job a1b2 comes again" in report_error(capsys, twice)


def test_a_restarted_log_reports_its_latest_job(tmp_path):
    path = write(tmp_path / "log-0.jsonl", rows(0, 30, job="old0") + rows(0, 20, job="new0"))
    logs = read_logs([path])
    assert logs.job == "new0" and analyse(logs)["job"]["iterations"] == 20
    assert analyse(read_logs([path], job="old0"))["job"]["iterations"] == 30


@pytest.mark.parametrize("content, expected", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "f.json:1: the frontier file is not UTF-8 text"),
    (b"[1, 2, 3]", "f.json: the frontier file: must be a JSON object, got list"),
    (b'{"schedule": {}, "blocking_power": NaN}', "the frontier file is not valid JSON"),
    (b'{"schedule": {}, "blocking_power": 60, "plans": [], "baseline": {}}', "f.json: plans: must be a non-empty"),
    (b'{"schedule": {}, "blocking_power": 60, "plans": [{"time": 1, "energy": -1, "frequencies": [[1]]}], '
     b'"baseline": {"time": 1, "energy": 1, "frequencies": [[1]]}}', "f.json: plans[0].energy: -1 is below 0"),
    (b'{"schedule": {}, "blocking_power": 60, "plans": [{"time": 1, "energy": 1, "frequencies": [[1]]}], '
     b'"baseline": {"time": 1, "energy": 0, "frequencies": [[1]]}}', "f.json: baseline.energy: must be positive"),
])
def test_a_bad_frontier_file_is_one_line(tmp_path, capsys, content, expected):
    log = write(tmp_path / "log-0.jsonl", rows(0, 20))
    (tmp_path / "f.json").write_bytes(content)
    err = report_error(capsys, log, extra=("--frontier", str(tmp_path / "f.json")))
    assert expected in err and "perseus.frontier_path" in err and "error: --frontier " in err


def test_an_output_that_cannot_be_written_names_its_flag_before_the_logs_are_read(tmp_path, capsys):
    log = write(tmp_path / "log-0.jsonl", rows(0, 20))
    assert "--output " in report_error(capsys, log, extra=("--output", str(tmp_path)))
    assert "--plot " in report_error(capsys, log, extra=("--plot", str(tmp_path / "timeline.txt")))


# ----------------------------------------------------------------------------- properties
LOG_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)
ROW_MUTATIONS = st.dictionaries(st.sampled_from(sorted(ROW) + ["job", "rank", "iteration"]), LOG_VALUES, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(st.binary(max_size=60), ROW_MUTATIONS.map(
    lambda change: json.dumps({**ROW, **change}).encode())), max_size=6))
def test_any_log_gives_a_report_or_an_input_error(tmp_path, lines):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        analyse(read_logs([path]))
    except InputError as err:
        assert str(path) in str(err) and "\n" not in str(err)


FRONTIER_PLAN = st.fixed_dictionaries({"time": LOG_VALUES, "energy": LOG_VALUES, "frequencies": st.one_of(
    LOG_VALUES, st.lists(st.lists(st.integers(-5, 2 ** 40), max_size=3), max_size=3))})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.one_of(st.binary(max_size=40), st.fixed_dictionaries(
    {"schedule": LOG_VALUES, "blocking_power": LOG_VALUES, "plans": st.one_of(LOG_VALUES, st.lists(FRONTIER_PLAN,
                                                                                                   max_size=2)),
     "baseline": FRONTIER_PLAN}, optional={"extension_start": LOG_VALUES}).map(
        lambda d: json.dumps(d).encode())))
def test_any_frontier_file_gives_a_frontier_or_an_input_error(tmp_path, document):
    path = tmp_path / "f.json"
    path.write_bytes(document)
    try:
        Frontier.load(path).intrinsic_saving()
    except PerseusError as err:
        assert str(path) in str(err) and "\n" not in str(err)


# ----------------------------------------------------------------------------- memory
def test_report_reads_its_logs_in_memory_independent_of_their_length(tmp_path):
    """tracemalloc's peak while analysing two ranks' logs of 5,000 and of 20,000 iterations
    (2 x 1.4 and 2 x 5.6 MB): the longer logs take no more memory, under 2 MB, less than even
    the shorter logs' size (before: ~7.5 x the logs)."""
    peaks = []
    for count in (5_000, 20_000):
        paths = [write(tmp_path / f"log-{count}-{rank}.jsonl", rows(rank, count)) for rank in (0, 1)]
        tracemalloc.start()
        analysis = analyse(read_logs(paths), timeline=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert analysis["job"]["iterations"] == count
    assert peaks[1] < 1.2 * peaks[0] + 100_000 and peaks[1] < 2_000_000, peaks


def test_the_report_command_never_shows_a_traceback_for_a_huge_number(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"iteration": 1e999999, "rank": 0, "phase": "deployed", "time_s": 1}\n')
    done = subprocess.run([sys.executable, "-m", "perseus_ext", "report", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "log.jsonl:1:" in done.stderr


def test_a_job_of_more_ranks_than_the_open_file_limit_is_reported(tmp_path):
    """One log per rank stays open while the ranks are merged: 300 ranks under a soft limit
    of 256 open files (the usual limit is 1,024, below a 1,024-rank job's)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    paths = [write(tmp_path / f"log-{rank}.jsonl", rows(rank, 12)) for rank in range(300)]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        analysis = analyse(read_logs(paths), timeline=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(analysis["ranks"]) == 300 and analysis["job"]["iterations"] == 12
