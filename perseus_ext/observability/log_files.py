"""The runtime's JSONL logs (`perseus.log_path`), read typed, bounded and one job at a time.

Why: `perseus-ext report` is fed whatever files a user globs: logs of several jobs, a log
appended across restarts, one rank's log twice, a truncated or binary file, a log of any length.
Every row is validated as a `LogRow` (`log_row.py`, the model the runtime writes them with:
finite, non-negative, physically possible figures, known phases) and a bad one is one error
naming the file, the line and the field. The files are read
twice, one line at a time, so memory does not grow with their length: a first pass finds, per
file and rank, where each run starts and which job wrote it; the second streams the chosen runs,
merged by iteration, into the report's accumulators.

A run is one rank's iterations of one job: rows carry the job's id (`job`, the same on every
rank). A log written before rows carried it tells runs apart by the iteration count going back,
and runs of different files by their wall-clock timestamps: the ranks of one job record their
iterations at the same time, so runs whose spans lie more than `JOB_GAP_S` apart are of two
jobs (two jobs that ran at the same time cannot be told apart this way). A report is one job's:
logs whose latest runs are of different jobs are refused (name one with `--job`), and so is a
rank given twice in one job -- never merged into one figure. A folder given instead of files
stands for the `*.jsonl` files directly in it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from perseus_ext.inputs import InputError, iter_lines, validate_json_line
from perseus_ext.observability.log_row import LogRow
from perseus_ext.observability.run_figures import DEPLOYED, Sample, label_of

JOB_GAP_S = 60.0  # runs without a job id further apart than this are of different jobs
LOG_SUFFIX = ".jsonl"
FIX = "give the JSONL files the runtime writes to perseus.log_path, unchanged"
WHAT = "perseus-ext log"


def sample_of(row: LogRow) -> Sample:
    """A log row as the report's statistics see it."""
    label = label_of(row.phase, row.fell_back, row.probe)
    return Sample(row.iteration, label, row.factor, row.time_s, row.energy_j,
                  row.plan if label == DEPLOYED else None, row.power_samples())


@dataclass(frozen=True)
class RankRun:
    """One rank's run in one file: where it starts, and what its first row said."""

    path: Path
    rank: int
    job: str | None
    start_offset: int
    start_line: int
    pipeline: int | None
    stage: int | None
    first_timestamp: float | None = None  # wall clock of its first and last rows that carry one
    last_timestamp: float | None = None

    def samples(self) -> Iterator[Sample]:
        """The run's samples in iteration order, read one line at a time."""
        last = -1
        for number, _, text in iter_lines(self.path, what=WHAT, fix=FIX, start_offset=self.start_offset,
                                          first_line=self.start_line):
            if not text.strip():
                continue
            row = validate_json_line(LogRow, text, path=self.path, line=number, fix=FIX)
            if row.rank != self.rank:
                continue
            if row.job != self.job or row.iteration <= last:
                return  # the next run of this rank
            last = row.iteration
            yield sample_of(row)


@dataclass(frozen=True)
class JobLogs:
    """The runs of one job, one per rank, sorted by rank."""

    job: str | None
    runs: tuple[RankRun, ...]

    def merged(self, on_sample: dict[int, Callable[[Sample], None]]) -> Iterator[tuple[int, list[Sample]]]:
        """(iteration, every rank's sample) for the iterations every rank recorded, in order;
        each rank's every sample also goes to `on_sample[rank]`."""
        _allow_open_files(len(self.runs) + 64)  # one open log per rank while merging
        streams = [run.samples() for run in self.runs]
        heads: list[Sample | None] = []
        for run, stream in zip(self.runs, streams):
            heads.append(_next(stream, on_sample[run.rank]))
        while all(head is not None for head in heads):
            target = max(head.iteration for head in heads)
            for k, run in enumerate(self.runs):
                while heads[k] is not None and heads[k].iteration < target:
                    heads[k] = _next(streams[k], on_sample[run.rank])
            if any(head is None for head in heads):
                break
            if all(head.iteration == target for head in heads):
                yield target, list(heads)
                for k, run in enumerate(self.runs):
                    heads[k] = _next(streams[k], on_sample[run.rank])
        for k, run in enumerate(self.runs):  # the rest of the longer runs, for the per-rank figures
            while heads[k] is not None:
                heads[k] = _next(streams[k], on_sample[run.rank])


def _allow_open_files(count: int) -> None:
    """Raise the soft limit on open files towards `count` (a job of 1,024 ranks passes the
    usual 1,024); past the hard limit, opening a log fails with an InputError that says so."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        resource.setrlimit(resource.RLIMIT_NOFILE, (count if hard == resource.RLIM_INFINITY else min(count, hard), hard))


def _next(stream: Iterator[Sample], callback: Callable[[Sample], None]) -> Sample | None:
    sample = next(stream, None)
    if sample is not None:
        callback(sample)
    return sample


def _scan(path: Path) -> list[RankRun]:
    """Every run the file holds, in the order they start (first pass)."""
    runs: list[RankRun] = []
    current: dict[int, tuple[RankRun, int, int]] = {}  # rank -> (its current run, last iteration, its line)
    spans: dict[int, list[float]] = {}  # id of a run -> [first, last] timestamp
    for number, offset, text in iter_lines(path, what=WHAT, fix=FIX):
        if not text.strip():
            continue
        row = validate_json_line(LogRow, text, path=path, line=number, fix=FIX)
        run = current.get(row.rank)
        if run is not None and row.job == run[0].job and row.iteration <= run[1]:
            if row.job is not None:
                raise InputError(path, f"iteration {row.iteration} of rank {row.rank} of job {row.job} comes again "
                                       f"after iteration {run[1]} (line {run[2]}): two processes wrote one rank's log",
                                 "give each rank's log once; give every process its own perseus.log_path "
                                 "(with {rank} in it)", line=number, field="iteration")
            run = None  # a log written before rows named their job: the count going back is a restart
        if run is None or row.job != run[0].job:
            new = RankRun(path, row.rank, row.job, offset, number, row.pipeline, row.stage)
            runs.append(new)
            run = (new, row.iteration, number)
        current[row.rank] = (run[0], row.iteration, number)
        if row.timestamp is not None:
            span = spans.setdefault(id(run[0]), [row.timestamp, row.timestamp])
            span[0], span[1] = min(span[0], row.timestamp), max(span[1], row.timestamp)
    return [dataclasses.replace(run, first_timestamp=spans[id(run)][0], last_timestamp=spans[id(run)][1])
            if id(run) in spans else run for run in runs]


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _refuse_runs_of_different_times(runs: list[RankRun]) -> None:
    """Runs without a job id are one job's only if their wall-clock spans meet (within
    `JOB_GAP_S`); otherwise refused, naming each group's files and times."""
    timed = sorted((run for run in runs if run.first_timestamp is not None), key=lambda run: run.first_timestamp)
    groups: list[list[RankRun]] = []
    for run in timed:
        if groups and run.first_timestamp <= max(r.last_timestamp for r in groups[-1]) + JOB_GAP_S:
            groups[-1].append(run)
        else:
            groups.append([run])
    if len(groups) < 2:
        return
    parts = []
    for group in groups:
        files = ", ".join(dict.fromkeys(str(run.path) for run in group))
        start, end = min(r.first_timestamp for r in group), max(r.last_timestamp for r in group)
        parts.append(f"rank{'s' * (len(group) > 1)} {', '.join(str(r.rank) for r in group)} in {files} ran "
                     f"{_when(start)} to {_when(end)}")
    raise InputError(groups[1][0].path, f"the logs are of {len(groups)} different jobs by their timestamps (their rows "
                                        f"carry no job id): {'; '.join(parts)}",
                     "give the logs of one job only (the ranks of one job ran at the same time)", field="timestamp")


def log_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The log files to read: each file as given, each folder as the `*.jsonl` files directly
    in it (what perseus.log_path = 'DIR/log-{rank}.jsonl' writes), in name order."""
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            files.append(path)
            continue
        found = sorted(child for child in path.iterdir() if child.suffix == LOG_SUFFIX and child.is_file())
        if not found:
            raise InputError(path, f"the folder holds no {LOG_SUFFIX} file",
                             "give the folder perseus.log_path writes to (e.g. 'logs/perseus-{rank}.jsonl' -> "
                             "logs), or the log files themselves")
        files += found
    return files


def _describe(job: str | None) -> str:
    return f"job {job}" if job is not None else "a job whose rows carry no job id (written before logs named their job)"


def read_logs(paths: Iterable[str | os.PathLike[str]], job: str | None = None) -> JobLogs:
    """The runs of one job from the logs (files, or folders of them): the job of the files'
    latest runs, or `job`."""
    paths = log_paths(paths)
    latest: list[RankRun] = []
    for path in paths:
        runs = _scan(path)
        if job is not None:
            runs = [run for run in runs if run.job == job]
        last_per_rank: dict[int, RankRun] = {}
        for run in runs:
            last_per_rank[run.rank] = run
        latest.extend(last_per_rank.values())
    if not latest:
        where = f"job {job}" if job is not None else "any job"
        raise InputError(", ".join(map(str, paths)), f"the logs hold no iteration records of {where}",
                         "give the JSONL files the runtime wrote to perseus.log_path" +
                         (" (--job: a job id the logs hold)" if job is not None else ""))
    jobs = dict.fromkeys(run.job for run in latest)
    if len(jobs) > 1:
        parts = []
        for name in jobs:
            files = sorted(dict.fromkeys(str(run.path) for run in latest if run.job == name))
            parts.append(f"{_describe(name)} in {', '.join(files)}")
        named = [name for name in jobs if name is not None]
        raise InputError(latest[0].path, f"the logs are of {len(jobs)} different jobs ({'; '.join(parts)})",
                         f"give one job's logs, or choose one with --job ({', '.join(named) or 'none named'})")
    if None in jobs:
        _refuse_runs_of_different_times(latest)
    by_rank: dict[int, RankRun] = {}
    for run in latest:
        other = by_rank.get(run.rank)
        if other is not None:
            raise InputError(run.path, f"rank {run.rank} of {_describe(run.job)} is also in {other.path} "
                                       f"(line {other.start_line})", "give each rank's log once",
                             line=run.start_line, field="rank")
        by_rank[run.rank] = run
    return JobLogs(next(iter(jobs)), tuple(by_rank[rank] for rank in sorted(by_rank)))
