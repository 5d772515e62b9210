"""The frontier solver's candidate plans (`solver.py`): the pool every step adds to, the
Pareto and gap-filling selections over it, and passes split over two threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from perseus_ext.background import start_background
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.first_pass import FirstPass, Replayed, replayed
from perseus_ext.planning.passes import CHOICE_DTYPE
from perseus_ext.planning.profile import pareto_indices

_EPS = 1e-9
FILL_BIN = 0.5  # gap-fill bin width as a fraction of the resolution
# Fewer plans than this go through a pass on one thread: below it, handing the GIL back and
# forth costs what the second thread gains.
SPLIT_COLUMNS = 1024


def in_two(work: Callable[[int, int], list[Replayed]], columns: int) -> list[Replayed]:
    """`work(lo, hi)` over the columns [0, columns), the second half on a helper thread, the
    parts joined column by column (the same candidates in the same order as `work(0, columns)`).

    The passes treat every plan (column) on its own, and numpy lets go of the GIL inside
    operations on rows this long: a reclaim pass over 2,118 plans at 8 x 96 took 114 ms on two
    threads instead of 180 ms.
    """
    if columns < SPLIT_COLUMNS:
        return work(0, columns)
    half = columns // 2
    second: list = []

    def run_second() -> None:
        try:
            second.append(work(half, columns))
        except BaseException as err:  # raised again below, in the solver's thread
            second.append(err)

    thread = start_background(threading.Thread(target=run_second, name="frontier-pass", daemon=True))
    try:
        first = work(0, half)
    finally:
        thread.join()
    if isinstance(second[0], BaseException):
        raise second[0]
    return [
        tuple(np.concatenate([a, b], axis=-1) for a, b in zip(left, right))
        for left, right in zip(first, second[0])
    ]


class CandidatePool:
    """Every candidate plan found so far (columns), with its replayed time and energy."""

    DTYPE = CHOICE_DTYPE  # int16 option indices (passes.py)

    def __init__(self, model: CostModel, buffer: np.ndarray, times: np.ndarray, energies: np.ndarray):
        """Candidates in `buffer`'s first len(times) columns; the pool grows into the rest."""
        self.model = model
        self._buffer = buffer
        self.size = len(times)
        self.times, self.energies = times, energies

    @classmethod
    def around(cls, first_pass: FirstPass, fastest: np.ndarray) -> "CandidatePool":
        """The pool in the first pass's buffer: its candidates, and `fastest` in column 0."""
        pool = cls(first_pass.model, *first_pass.hand_over())
        pool._buffer[:, :1] = fastest
        pool.times[:1], pool.energies[:1] = first_pass.model.replay(fastest)
        return pool

    @property
    def choices(self) -> np.ndarray:
        """(N, plans) option indices of every candidate (a view; `add` may reallocate)."""
        return self._buffer[:, : self.size]

    def add(self, choices: np.ndarray) -> None:
        self.extend(*replayed(self.model, choices))

    def extend_all(self, parts: list[Replayed]) -> None:
        """Append replayed candidates, part by part."""
        for part in parts:
            self.extend(*part)

    def extend(self, choices: np.ndarray, times: np.ndarray, energies: np.ndarray) -> None:
        """Append plans whose replayed times and energies the caller has."""
        end = self.size + choices.shape[1]
        if end > self._buffer.shape[1]:  # grow by half: amortised O(1) per plan
            grown = np.empty((self._buffer.shape[0], max(end, self._buffer.shape[1] * 3 // 2)), self.DTYPE)
            grown[:, : self.size] = self.choices
            self._buffer = grown
        self._buffer[:, self.size : end] = choices
        self.size = end
        self.times = np.r_[self.times, times]
        self.energies = np.r_[self.energies, energies]

    def best_for(self, deadlines: np.ndarray) -> np.ndarray:
        """Choices of the lowest-energy plan meeting each deadline."""
        return self.choices[:, best_so_far(self.times, self.energies, deadlines)]

    def frontier(self, resolution: float) -> np.ndarray:
        """Indices of the Pareto plans plus the gap-filling ones, by time."""
        return fill_gaps(self.times, self.energies, pareto(self.times, self.energies), resolution)


def even_block(columns: int, block: int) -> int:
    """Columns per block when `columns` are cut into as few blocks of at most `block` as
    possible, all about the same size: a short last block would go through its pass on one
    thread (`SPLIT_COLUMNS`) while the other core waits (8 x 96: 3,061 deadlines were 2,604 +
    457)."""
    blocks = max(1, -(-columns // block))
    return max(1, -(-columns // blocks))


def best_so_far(times: np.ndarray, energies: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
    """For each deadline, the index of the lowest-energy plan whose time meets it."""
    order = np.argsort(times, kind="stable")
    sorted_energy = energies[order]
    running = np.minimum.accumulate(sorted_energy)
    # position of the running minimum within the sorted order
    arg = np.arange(len(order))
    arg = np.where(sorted_energy == running, arg, 0)
    arg = np.maximum.accumulate(arg)
    count = np.searchsorted(times[order], deadlines + _EPS, side="right")
    return order[arg[np.maximum(count - 1, 0)]]


def gap_deadlines(kept_times: np.ndarray, resolution: float) -> tuple[np.ndarray, np.ndarray]:
    """(index of the plan starting each gap, deadline) pairs, finely spaced inside each gap."""
    starts, deadlines = [], []
    bin_width = resolution * FILL_BIN
    for k, (a, b) in enumerate(zip(kept_times[:-1], kept_times[1:])):
        if b - a > 2 * bin_width:
            inner = np.arange(a + bin_width, b, bin_width)
            starts += [k] * len(inner)
            deadlines += inner.tolist()
    return np.array(starts, dtype=np.int64), np.array(deadlines)


def fill_gaps(times: np.ndarray, energies: np.ndarray, keep: list[int], resolution: float) -> np.ndarray:
    """Add, inside every gap wider than `resolution` between Pareto plans, the lowest-energy
    candidate of each bin (bins half the resolution wide: plans in neighbouring bins are less
    than `resolution` apart).

    Such gaps only occur where the frontier is flat (a slower plan cannot beat a faster one by
    more than rounding noise); the fill keeps the promised time resolution, and the straggler
    lookup still picks the cheapest plan meeting a deadline.
    """
    kept_times = times[keep]
    bin_width = resolution * FILL_BIN
    # Each candidate's gap k: kept_times[k] < t < kept_times[k + 1], the gap wider than 2 bins.
    after = np.searchsorted(kept_times, times, side="left")
    gap = after - 1
    inside = (after > 0) & (after < len(kept_times))
    inside[inside] &= times[inside] < kept_times[after[inside]]
    inside[inside] &= kept_times[after[inside]] - kept_times[gap[inside]] > 2 * bin_width
    members = np.flatnonzero(inside)
    gaps = gap[members]
    bins = np.floor((times[members] - kept_times[gaps]) / bin_width).astype(np.int64)
    # the lowest energy of each (gap, bin); the first candidate among equals
    order = np.lexsort((members, energies[members], bins, gaps))
    first = np.r_[True, (np.diff(gaps[order]) != 0) | (np.diff(bins[order]) != 0)][: len(order)]
    # The kept and filling candidates without repeats, by time, then energy, then index (a mask:
    # np.unique imports numpy.ma, the CLI's start-up time; a Python sort with a key took ~1 ms).
    chosen = np.zeros(len(times), dtype=bool)
    chosen[keep] = True
    chosen[members[order[first]]] = True
    out = np.flatnonzero(chosen)
    return out[np.lexsort((energies[out], times[out]))]


def pareto(times: np.ndarray, energies: np.ndarray) -> list[int]:
    """Indices of Pareto-optimal (time, energy) points, by increasing time. Times within 1e-12 s
    count as equal: replays of different plans along the same critical path can differ by
    rounding, and a costlier plan must not win on that."""
    return pareto_indices(np.round(times, 12), energies, tolerance=1e-9)
