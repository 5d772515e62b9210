"""Steps 2-3 of the frontier solver (`solver.py`) at every grid deadline: relaxed durations
rounded to profiled clocks and the slack reclaimed, done on the LP walk's own threads.

Each end of the walk (`relaxation.AnchorWalk`) solves its share of the anchors; the two shares
never take exactly as long (8 x 24: the low end was done ~30 ms before the high end, and the
grid's ~35 ms of rounding then ran on one core after both). So an end that has solved its
anchors goes on rounding: the grid is cut into blocks, and a block is taken as soon as the
anchors around its deadlines are solved, while the other end still walks. Which thread rounds a
block changes nothing: a block's candidates depend only on its deadlines and its anchors, and
they are joined in grid order at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.passes import CELLS, CHOICE_DTYPE, REPLAY_CELLS, chunk_columns, reclaim_slack, round_to_options
from perseus_ext.planning.relaxation import AnchorWalk, interpolate
from perseus_ext.planning.switching import repair_latency

Replayed = tuple[np.ndarray, np.ndarray, np.ndarray]  # (choices, times, energies) of plans
# Grid deadlines per block: small enough that the passes' (computations x plans) intermediates
# stay in cache, large enough that numpy's per-call cost stays small against the work.
BLOCK_COLUMNS = 256
_REPAIR_STRIDE = 2  # the latency repair works on every other grid deadline


class FirstPass:
    """Rounds every grid deadline, block by block, on the threads of the walk it is handed to
    (`AnchorWalk(..., then=first_pass.take_blocks)`), writing the candidates straight into the
    candidate pool's buffer: the first pass's plans are never held twice (16 x 128: ~70 MiB).

    `make_grid(walk)`: the grid deadlines, from the kept anchors (the first end done builds it).
    `room(deadlines)`: columns to allocate for that many grid deadlines (the pool grows into
    the rest); column 0 is left for the caller, the first pass's candidates follow in grid
    order, each block's kinds in `first_pass_block`'s order.
    """

    def __init__(
        self, model: CostModel, make_grid: Callable[[AnchorWalk], np.ndarray], room: Callable[[int], int]
    ):
        self.model = model
        self._make_grid = make_grid
        self._room = room
        self._lock = threading.Lock()
        self.grid: np.ndarray | None = None
        # Per block: (first, end, first anchor, last anchor, its first column).
        self._blocks: list[tuple[int, int, int, int, int]] = []
        self._unclaimed: list[int] = []
        self._done: set[int] = set()
        self.choices = self.times = self.energies = np.empty(0)

    def take_blocks(self, walk: AnchorWalk) -> None:
        """Round blocks until none is left unclaimed (or the walk is cancelled)."""
        with self._lock:
            if self.grid is None:
                self._cut(walk)
        while True:
            with walk.anchor_solved:
                claimed = self._claim(walk)
                while claimed is None and self._unclaimed and not walk.cancelled:
                    walk.anchor_solved.wait()
                    claimed = self._claim(walk)
            if claimed is None:
                return
            block, columns = claimed
            first, end, first_anchor, last_anchor, column = self._blocks[block]
            anchors = walk.deadlines[first_anchor : last_anchor + 1]
            deadlines = self.grid[first:end]
            for choices, times, energies in first_pass_block(
                self.model, interpolate(anchors, columns, deadlines), deadlines, first
            ):
                after = column + choices.shape[1]
                self.choices[:, column:after] = choices
                self.times[column:after], self.energies[column:after] = times, energies
                column = after
            self._done.add(block)

    def hand_over(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, times, energies) once the walk's threads have ended: the buffer's first
        len(times) columns hold candidates (column 0 the caller's). The first pass lets go of
        them, so a pool that outgrows the buffer frees it (16 x 128 x 4: 250 MiB)."""
        if len(self._done) != len(self._blocks):
            raise RuntimeError("the first pass is incomplete: the LP walk ended before every block was rounded")
        handed = self.choices, self.times, self.energies
        self.choices = self.times = self.energies = np.empty(0)
        return handed

    def reclaimed_columns(self) -> np.ndarray:
        """For each grid deadline, the column of its own reclaimed plan: its relaxed durations
        rounded down, slowed into its slack (each block's first kind)."""
        return np.concatenate([column + np.arange(end - first) for first, end, _, _, column in self._blocks])

    def _cut(self, walk: AnchorWalk) -> None:
        """The grid, its blocks, the anchors each block interpolates between, and the pool's
        buffer with every block's columns."""
        grid = self._make_grid(walk)
        anchors = walk.deadlines
        column = 1
        # Two blocks are rounded at once: together no more than `CELLS`, what one pass of the
        # grid held before (16 x 128 x 4: 122 deadlines a block; 256 elsewhere).
        width = min(BLOCK_COLUMNS, max(32, CELLS // (2 * self.model.num_nodes)))
        for first in range(0, len(grid), width):
            end = min(first + width, len(grid))
            if len(anchors) == 1:
                low = high = 0
            else:  # `interpolate`'s neighbours of the block's first and last deadlines
                low, high = (
                    int(np.clip(np.searchsorted(anchors, grid[k], side="left"), 1, len(anchors) - 1))
                    for k in (first, end - 1)
                )
                low -= 1
            self._blocks.append((first, end, low, high, column))
            column += _candidate_count(self.model, first, end)
        self.choices = np.empty((self.model.num_nodes, max(column, self._room(len(grid)))), dtype=CHOICE_DTYPE)
        self.times, self.energies = np.empty(column), np.empty(column)
        self._unclaimed = list(range(len(self._blocks)))
        self.grid = grid

    def _claim(self, walk: AnchorWalk) -> tuple[int, np.ndarray] | None:
        """The first unclaimed block whose anchors are all solved, with their durations
        (call holding `walk.anchor_solved`)."""
        for position, block in enumerate(self._unclaimed):
            low, high = self._blocks[block][2:4]
            columns = walk.anchor_columns(low, high)
            if columns is not None:
                del self._unclaimed[position]
                return block, columns
        return None


def _candidate_count(model: CostModel, first: int, end: int) -> int:
    """Candidates `first_pass_block` makes for grid deadlines first..end - 1."""
    repaired = len(range(end - first)[_repaired(first)]) if model.switch_latency_s > 0 else 0
    return 3 * (end - first) + repaired


def _repaired(first: int) -> slice:
    """The deadlines of a block starting at grid deadline `first` whose plans the latency repair
    works on: every `_REPAIR_STRIDE`-th of the grid."""
    return slice((-first) % _REPAIR_STRIDE, None, _REPAIR_STRIDE)


def first_pass_block(model: CostModel, relaxed: np.ndarray, deadlines: np.ndarray, first: int) -> list[Replayed]:
    """Steps 2-3 for a block of grid deadlines (the first is grid deadline `first`): relaxed
    durations rounded three ways, the `down` plans' slack reclaimed (with latency, every other
    one also repaired); each kind of candidate replayed, in a fixed order."""
    rounded = round_to_options(model, relaxed)
    feasible = reclaim_slack(model, rounded["down"], deadlines)
    kinds = [feasible]
    if model.switch_latency_s > 0:
        # Latency makes most of these plans late; win their deadlines back (every other grid
        # deadline: neighbours differ by little and the pass costs a few replays).
        stride = _repaired(first)
        late, late_deadlines = feasible[:, stride], deadlines[stride]
        step = chunk_columns(model.num_nodes, REPLAY_CELLS)  # its latency replays stay in cache
        kinds.append(np.concatenate([
            repair_latency(model, late[:, j : j + step], late_deadlines[j : j + step])
            for j in range(0, late.shape[1], step)
        ], axis=1))
    kinds += [rounded["up"], rounded["nearest"]]
    return [replayed(model, choices) for choices in kinds]


def replayed(model: CostModel, choices: np.ndarray) -> Replayed:
    """(choices, times, energies) of plans (columns), replayed in cache-sized column chunks."""
    step = chunk_columns(model.num_nodes, REPLAY_CELLS)
    parts = [model.replay(choices[:, k : k + step]) for k in range(0, choices.shape[1], step)]
    return choices, np.concatenate([t for t, _ in parts]), np.concatenate([e for _, e in parts])
