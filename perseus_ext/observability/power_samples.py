"""A rank's measured GPU power at a fine rate, and the swing of a run's deployed iterations.

Why: the swing a site sees (peak to trough within an iteration, the ramp of a 50 ms moving
average, docs/power.md) needs power samples far finer than an iteration. Where the device knows
its power that finely (the simulated device: its power is exact, `measurement/gpu/sim/power_log.py`)
every iteration record carries its rank's power as the mean over each millisecond of device
time, on a grid anchored at device time 0, so the bins of different ranks line up and sum into
the job's power without resampling. A real GPU's default power reading is averaged over a second
on H100/H200 and of unknown rate elsewhere (docs/monitoring.md): its records carry none, and no
swing is claimed for it.

A record covers the device time from the previous iteration's end marker to its own (its own
start marker for the first), so consecutive records tile the run with nothing left between them:
the optimizer step, the data-parallel wait and the host's gaps all count.

The measured swing of a rank is that of its last run of consecutive deployed iterations on one
plan (no baseline probe, no fallback; at most `MAX_ITERATIONS` iterations, `MAX_BINS` samples),
read as one period of a periodic trace (`planning.power_swing.swing_figures`). For the job, the
ranks' samples over the iterations all their runs hold are summed bin by bin, over the device
time all ranks cover: from the latest rank's start of the first iteration to the earliest rank's
end of the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from perseus_ext.planning.power_swing import MODEL_SAMPLE_PERIOD_S, SwingFigures, swing_figures

POWER_BIN_S = MODEL_SAMPLE_PERIOD_S  # 1 ms: the planner's model figures read traces at the same rate
MAX_ITERATIONS = 50  # the swing of the last this-many deployed iterations
MAX_BINS = 120_000  # two minutes of 1 ms samples: the job's reduction stays small
SOURCE = "simulated device: exact mean power per 1 ms of device time"
NO_DEPLOYED_RUN = "no deployed iterations with power samples (warm-up, profiling, probes or a fallback only)"
NO_SHARED_RUN = "the ranks' deployed runs with power samples share no iteration"
NOT_MEASURED = ("no power samples finer than an iteration: a real GPU's power reading is averaged over about "
                "a second (NVML), so no swing is claimed (docs/monitoring.md)")


@dataclass(frozen=True, eq=False)
class PowerSamples:
    """Mean watts over consecutive bins of `period_s` device seconds: bin b spans
    [b period, (b + 1) period), the first is `first_bin`."""

    period_s: float
    first_bin: int
    watts: np.ndarray

    @property
    def end_bin(self) -> int:
        return self.first_bin + len(self.watts)

    @property
    def seconds(self) -> float:
        return len(self.watts) * self.period_s

    def window(self, first_bin: int, end_bin: int) -> np.ndarray:
        """The samples of bins first_bin .. end_bin - 1 (they must lie within these)."""
        if not self.first_bin <= first_bin <= end_bin <= self.end_bin:
            raise ValueError(f"bins {first_bin}..{end_bin} are outside {self.first_bin}..{self.end_bin}")
        return self.watts[first_bin - self.first_bin:end_bin - self.first_bin]

    def swing(self) -> SwingFigures:
        return swing_figures(self.watts, self.period_s)


@dataclass(frozen=True)
class IterationPower:
    """One iteration's power on one rank, with the plan it ran (None: not a deployed plan
    iteration: warm-up, profiling, a baseline probe, a fallback)."""

    iteration: int
    plan: int | None
    samples: PowerSamples


class DeployedRun:
    """The last run of consecutive deployed iterations on one plan whose samples tile device time
    (each starts at the bin the previous ends), fed one iteration at a time: at most
    `MAX_ITERATIONS` are kept, so a log of any length is read in bounded memory. An iteration
    without a plan (a probe, a fallback) ends a run; the run before it stays the last one until
    another begins."""

    def __init__(self) -> None:
        self._run: deque[IterationPower] = deque(maxlen=MAX_ITERATIONS)
        self._last = self._run

    def add(self, item: IterationPower) -> None:
        if item.plan is None:
            self._run = deque(maxlen=MAX_ITERATIONS)
            return
        previous = self._run[-1] if self._run else None
        if previous is not None and not (item.iteration == previous.iteration + 1 and item.plan == previous.plan
                                         and item.samples.first_bin == previous.samples.end_bin):
            self._run = deque(maxlen=MAX_ITERATIONS)
        self._run.append(item)
        self._last = self._run

    def items(self) -> list[IterationPower]:
        """The run, its oldest iterations dropped past `MAX_BINS` samples."""
        run = list(self._last)
        while run and run[-1].samples.end_bin - run[0].samples.first_bin > MAX_BINS:
            run.pop(0)
        return run


def deployed_run(iterations: Sequence[IterationPower]) -> list[IterationPower]:
    """`DeployedRun` over `iterations`, in order."""
    collector = DeployedRun()
    for item in iterations:
        collector.add(item)
    return collector.items()


def joined(run: Sequence[IterationPower]) -> PowerSamples:
    """The run's samples as one (the run tiles device time: `deployed_run`)."""
    first = run[0].samples
    return PowerSamples(first.period_s, first.first_bin, np.concatenate([item.samples.watts for item in run]))


def swing_summary(samples: PowerSamples, iterations: Sequence[int], ranks: int = 1) -> dict[str, Any]:
    """The JSON of a measured swing: the figures, what they span, and where they come from."""
    figures = samples.swing()
    return {
        "measured": True, "mean_w": figures.mean_w, "peak_to_trough_w": figures.peak_to_trough_w,
        "peak_to_trough_fraction": figures.peak_to_trough_fraction,
        "max_ramp_w_per_s": figures.max_ramp_w_per_s, "band_energy_w2": figures.band_energy_w2,
        "band_energy_fraction": figures.band_energy_fraction,
        "iterations": [min(iterations), max(iterations)], "seconds": samples.seconds, "ranks": ranks,
        "sample_period_s": samples.period_s, "source": SOURCE,
    }


def rank_swing(run: Sequence[IterationPower], any_samples: bool) -> dict[str, Any]:
    """A rank's measured swing over its deployed run (`DeployedRun.items`), or why there is none
    (`any_samples`: whether the rank had power samples at all)."""
    if run:
        return swing_summary(joined(run), [item.iteration for item in run])
    return {"measured": False, "why": NO_DEPLOYED_RUN if any_samples else NOT_MEASURED}


@dataclass(frozen=True)
class JobWindow:
    """The iterations and device-time bins over which every rank's samples are summed."""

    iterations: tuple[int, int]  # first, last
    first_bin: int
    end_bin: int


def job_window(per_iteration: Sequence[tuple[int, int, int, int]], ranks: int) -> JobWindow | None:
    """The job's window from per-iteration figures reduced over the ranks, in iteration order:
    (iteration, ranks whose deployed run holds it, latest first bin, earliest end bin). The last
    run of consecutive iterations every rank holds, capped like a rank's; None when there is none
    or the ranks share no device time. Each rank's run is on one plan (`DeployedRun`); pipelines
    may run different plans (a straggler's), the job's trace is periodic all the same."""
    run: list[tuple[int, int, int, int]] = []
    for entry in per_iteration:
        if entry[1] < ranks:
            run = []
        elif run and entry[0] != run[-1][0] + 1:
            run = [entry]
        else:
            run.append(entry)
    run = run[-MAX_ITERATIONS:]
    while run and run[-1][3] - run[0][2] > MAX_BINS:
        run.pop(0)
    if not run or run[-1][3] <= run[0][2]:
        return None
    return JobWindow((run[0][0], run[-1][0]), run[0][2], run[-1][3])


def job_view(runs: Sequence[Sequence[IterationPower]]) -> list[tuple[int, int, int, int]]:
    """`job_window`'s input from every rank's deployed run, computed in one process (the report)."""
    figures: dict[int, list[int]] = {}
    for run in runs:
        for item in run:
            entry = figures.setdefault(item.iteration, [0, item.samples.first_bin, item.samples.end_bin])
            entry[0] += 1
            entry[1], entry[2] = max(entry[1], item.samples.first_bin), min(entry[2], item.samples.end_bin)
    return [(iteration, *values) for iteration, values in sorted(figures.items())]


def job_swing(runs: Sequence[Sequence[IterationPower]]) -> dict[str, Any]:
    """The job's measured swing from every rank's deployed run (`DeployedRun.items`; the report's
    way, the runtime's close reduces the same figures over the control plane): the ranks' samples
    summed over the window their runs all cover; or why there is none."""
    if not runs or not any(runs):
        return {"measured": False, "why": NOT_MEASURED}
    window = job_window(job_view(runs), len(runs)) if all(runs) else None
    if window is None:
        return {"measured": False, "why": NO_SHARED_RUN}
    total = np.zeros(window.end_bin - window.first_bin)
    for run in runs:
        total += joined(run).window(window.first_bin, window.end_bin)
    period = runs[0][0].samples.period_s
    return swing_summary(PowerSamples(period, window.first_bin, total), window.iterations, len(runs))
