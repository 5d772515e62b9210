"""Step 1 of the frontier solver (`solver.py`): the convex relaxation at anchor deadlines.

Each computation's cost c_i(t) = e_i(t) - P_block t is replaced by the lower convex hull of its
profiled (time, cost) points; the problem becomes an LP over start times and hull-segment fills,
solved exactly with HiGHS and warm-started from one anchor deadline to the next. Between
anchors, the convex combination of the two neighbouring LP solutions is feasible for the
interpolated deadline (the constraints are linear), so every grid deadline gets a relaxed plan
in O(N) (`interpolate`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import highspy
import numpy as np

from perseus_ext.background import start_background
from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel

_EPS = 1e-9
_QuietHighs = getattr(getattr(highspy, "_core", None), "_Highs", highspy.Highs)


class ConvexRelaxation:
    """The LP over start times and convex-hull segment fills, kept warm across deadlines."""

    def __init__(self, model: CostModel):
        self.model = model
        dag = model.dag
        n = len(dag)
        p = model.blocking_power
        # Lower convex hull of (time, cost) per node; nodes sharing options share hulls.
        segments: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # (lengths, slopes) per table
        per_node = []
        for i in range(n):
            k = model.num_options[i]
            t = model.times[i, :k]
            c = model.energies[i, :k] - p * t
            key = t.tobytes() + c.tobytes()
            if key not in segments:
                hull = lower_hull(t, c)
                lengths = np.diff(t[hull])
                segments[key] = (lengths, np.diff(c[hull]) / lengths)
            per_node.append(segments[key])
        count = np.array([len(lengths) for lengths, _ in per_node], dtype=np.int64)
        self.seg_node = np.repeat(np.arange(n), count)
        self.seg_len = np.concatenate([lengths for lengths, _ in per_node])
        seg_slope = np.concatenate([slopes for _, slopes in per_node])
        self.t_min = model.times[:, 0].copy()
        m = len(self.seg_node)

        # Variables: [start_0..start_{n-1}, fill_0..fill_{m-1}, T]. Every row says "node a
        # finishes before b starts" (b a successor's start, or T for a sink):
        #   start_a + sum fills(a) - x_b <= -t_min_a
        t_col = n + m
        sinks = np.flatnonzero(dag.out_degree == 0)
        before = np.r_[dag.pred_idx, sinks]
        after = np.r_[np.repeat(np.arange(n), dag.in_degree), np.full(len(sinks), t_col)]
        first_fill = n + np.r_[0, np.cumsum(count)[:-1]]
        width = 2 + count[before]  # entries per row: a, b and a's fills
        rows = np.repeat(np.arange(len(before)), width)
        slot = np.arange(len(rows)) - np.repeat(np.cumsum(width) - width, width)
        a = before[rows]
        cols = np.where(slot == 0, a, np.where(slot == 1, after[rows], first_fill[a] + slot - 2))
        rhs = -self.t_min[before]
        r = len(rhs)
        start, index, value = csc_matrix(rows, cols, np.where(slot == 1, -1.0, 1.0), n + m + 1)

        lp = highspy.HighsLp()
        lp.num_col_ = n + m + 1
        lp.num_row_ = r
        lp.col_cost_ = np.concatenate([np.zeros(n), seg_slope, [0.0]])
        lp.col_lower_ = np.zeros(n + m + 1)
        lp.col_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), self.seg_len, [0.0]])
        lp.row_lower_ = np.full(r, -highspy.kHighsInf)
        lp.row_upper_ = rhs
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        self._lp = lp
        self.highs = simplex_highs(lp)
        self.t_col = t_col
        self.n, self.m = n, m
        # The LP omits each node's cost at its fastest clock: a plan's energy is objective +
        # this + P_block S T (`energy.py`).
        self.constant_j = float((model.energies[:, 0] - p * model.times[:, 0]).sum())
        # The relaxed optimum's energy (LP objective + the above + P_block S T) at the last
        # solve's deadline and over every deadline (`min_energy_deadline`): `AnchorWalk.lower_bound`.
        self.optimum_j = self.free_optimum_j = -np.inf

    def release(self) -> None:
        """Free HiGHS's copy of the LP, its factorisation and solution (~80 MiB each at
        16 x 128 x 4): its end of the walk has solved its anchors."""
        self.highs.clear()

    def twin(self) -> "ConvexRelaxation":
        """The same LP in a second HiGHS instance (another thread can walk it)."""
        twin = copy.copy(self)
        twin.highs = simplex_highs(self._lp)
        return twin

    def min_energy_deadline(self, t_min: float, t_slowest: float) -> float:
        """The relaxed minimum-energy deadline in [t_min, t_slowest]: the LP with the deadline
        free and priced at the blocking power of every GPU."""
        h = self.highs
        h.changeColCost(self.t_col, self.model.blocking_power * self.model.num_stage_gpus)
        h.changeColBounds(self.t_col, t_min, t_slowest)
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"LP relaxation with a free deadline ended with {h.modelStatusToString(status)}")
        t_star = float(h.getSolution().col_value[self.t_col])
        self.free_optimum_j = h.getObjectiveValue() + self.constant_j
        h.changeColCost(self.t_col, 0.0)
        return t_star

    def durations(self, deadline: float) -> np.ndarray:
        """Relaxed optimal durations at `deadline` (warm-started from the previous solve)."""
        h = self.highs
        h.changeColBounds(self.t_col, deadline, deadline)
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"LP relaxation at T={deadline:.6f}s ended with {h.modelStatusToString(status)}")
        x = h.getSolution().col_value  # a list: np.fromiter reads it in half np.asarray's time
        self.optimum_j = (
            h.getObjectiveValue() + self.constant_j
            + self.model.blocking_power * self.model.num_stage_gpus * deadline
        )
        fills = np.clip(np.fromiter(x[self.n : self.n + self.m], float, self.m), 0.0, self.seg_len)
        return self.t_min + np.bincount(self.seg_node, weights=fills, minlength=self.n)


def simplex_highs(lp: "highspy.HighsLp") -> "highspy.Highs":
    """A quiet HiGHS instance holding `lp`, solved by simplex (warm starts).

    highspy's `Highs()` (1.16) logs its banner to stdout while it is constructed, before
    `output_flag` can be set: in the middle of `perseus-ext frontier`'s output, and once per
    solve in training logs. The compiled class it wraps (`highspy._core._Highs`) does not, and
    has every method used here; a highspy release without that class gets the wrapper.

    One HiGHS thread: its simplex is serial, and the worker threads it starts by default only
    took small tasks and shared the walk's cores (16 x 128: 10.5-10.7 s wall and 16.4 s CPU,
    with one thread 9.1-9.7 s and 14.7-15.7 s, the same frontier). HiGHS keeps one task
    scheduler per calling thread and a scheduler cannot change its size, so this is safe only
    because every solve runs on `AnchorWalk`'s own threads, which end with the walk: another
    thread's HiGHS, with any thread count, is not touched.

    No presolve: only each end's first (cold) solve would run it (a warm start skips it), and
    on this LP it removes few rows for more than it saves on the cold solves.
    """
    highs = quiet_highs()
    set_option(highs, "solver", "simplex")
    set_option(highs, "threads", 1)
    set_option(highs, "presolve", "off")
    highs.passModel(lp)
    return highs


def quiet_highs() -> "highspy.Highs":
    """A HiGHS instance that prints nothing: no banner (`simplex_highs`), no log."""
    highs = _QuietHighs()
    set_option(highs, "output_flag", False)
    set_option(highs, "log_to_console", False)
    return highs


def set_option(highs: "highspy.Highs", name: str, value: object) -> None:
    """Set a HiGHS option, or raise `SolverError`: `setOptionValue` only returns an error
    status for a name or value it does not take (a renamed option in a later highspy would
    otherwise be ignored without a word; `threads` above is what keeps HiGHS's task scheduler
    on the walk's own threads)."""
    if highs.setOptionValue(name, value) != highspy.HighsStatus.kOk:
        raise SolverError(f"HiGHS (highspy) did not take its option {name}={value!r}: is this highspy release supported?")


def csc_matrix(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, num_cols: int):
    """(column starts, row indices, values) of a sparse matrix given as distinct triplets
    (what HiGHS takes; building it with numpy spares the CLI scipy's import time)."""
    order = np.lexsort((rows, cols))
    starts = np.r_[0, np.cumsum(np.bincount(cols, minlength=num_cols))]
    return starts, rows[order], values[order]


def lower_hull(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by increasing t."""
    hull: list[int] = []
    for i in range(len(t)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above segment a-i: drop it.
            if (c[b] - c[a]) * (t[i] - t[a]) >= (c[i] - c[a]) * (t[b] - t[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.array(hull, dtype=np.int64)


class AnchorWalk:
    """The LP walk over anchor deadlines from T_min to just past the relaxed minimum-energy
    deadline T*, solved from both ends at once on two background threads.

    Anchors lie on `count` evenly spaced deadlines from T_min to `t_slowest` (all clocks
    slowest), each moved to the nearest deadline of the solver's grid (`grid_step(last anchor)`
    apart from T_min): such a deadline then rounds an LP optimum instead of a blend of two,
    which rounds worse (docs/solver.md). The high end first solves the LP with the deadline
    free and priced at the blocking power, which gives T* (slower than that, energy only
    grows: blocking power outweighs what slower clocks save); the walk keeps the anchors up to
    two past T*, every one over the fastest `DENSE_SHARE` of that range and every other one
    beyond, where the frontier is flat and interpolating between anchors loses little.

    HiGHS releases the GIL while it solves, so the two ends run on two cores (rounding deadlines
    meanwhile, as anchors arrive, gained nothing: it slows the walk as much as it saves, at
    8 x 24 and 8 x 96 alike). The low end walks up from T_min, the high end down from the last
    anchor, and they meet at a fixed deadline (`LOW_END_SHARE` of the range): which end solves
    an anchor must not depend on thread timing, because a degenerate LP has several optimal
    solutions and the one found depends on the basis the solve starts from. `progress` shows a
    tqdm bar.

    `then(walk)`, if given, runs on each end's thread once that end has solved its anchors (the
    solver rounds deadlines there while the other end still walks: `anchor_columns` and
    `anchor_solved` tell it which anchors are ready); its errors stop the walk like the ends' own.
    """

    DENSE_SHARE = 0.4
    # Most simplex iterations, and the cold start, lie near T_min, and the anchors are denser
    # there. The low end takes the fastest 40 % of the range, so the high end is done first and
    # rounds the grid blocks below it as the low end walks past them (`first_pass.py`); with a
    # smaller share the low end finished first while the blocks it could take next lay where
    # the high end was still walking.
    LOW_END_SHARE = 0.4

    def __init__(
        self, model: CostModel, count: int, t_min: float, t_slowest: float,
        grid_step: Callable[[float], float], progress: bool = False, to_slowest: bool = False,
        t_least_energy: float | None = None, then: "Callable[[AnchorWalk], None] | None" = None,
    ):
        """`count` anchors span T_min to `t_least_energy` (every computation at its clock of least
        energy; default `t_slowest`), which bounds where the frontier's energy stops falling much
        better than the all-slowest plan does once clocks useful only with slack are planned
        with; positions continue at that spacing to `t_slowest`. `to_slowest`: after the
        ordinary anchors (up to two past T*), also anchors up to the all-slowest plan, on the
        same grid (the wait-aware extension's deadlines), spaced as `count` anchors would be
        over the whole range, every other one."""
        t_slowest = max(t_slowest, t_min)
        span_end = t_slowest if t_least_energy is None else min(max(t_least_energy, t_min), t_slowest)
        if span_end - t_min < _EPS:
            span_end = t_slowest
        if t_slowest - t_min < _EPS:  # slower clocks save no time: a single deadline
            count = 1
        self._spacing = (span_end - t_min) / max(count - 1, 1)
        # Anchor positions from T_min (0) to the all-slowest plan (the last).
        positions = count if count == 1 else int(np.ceil((t_slowest - t_min) / self._spacing - _EPS)) + 1
        self._t_min, self._t_slowest, self._count = t_min, t_slowest, positions
        wide = (t_slowest - t_min) / max(count - 1, 1)
        self._extension_stride = 2 * max(1, int(round(wide / self._spacing))) if count > 1 else 2
        self._grid_step = grid_step
        self._to_slowest = to_slowest
        self.ordinary_end = t_min  # the last ordinary anchor, once the high end knows T*
        # The kept anchors by position (only T_min until the high end knows T*).
        self._deadlines = np.array([t_min])
        self._columns: dict[int, np.ndarray] = {}  # relaxed durations by kept anchor
        self._optima: dict[int, float] = {}  # `ConvexRelaxation.optimum_j` by kept anchor
        self._t_star, self._free_optimum_j = t_slowest, -np.inf  # once the high end knows them
        self._split = 1  # the first anchor the high end solves
        # Set once the kept anchors and the split are known (or the walk is cancelled).
        self._anchors_known = threading.Event()
        if count == 1:
            self._anchors_known.set()
        self._cancelled = False
        # Notified whenever an anchor is solved or the walk is cancelled.
        self.anchor_solved = threading.Condition()
        self._then = then
        self._error: BaseException | None = None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=count, desc="frontier LP anchors", unit="anchor")
        relaxation = ConvexRelaxation(model)
        ends = [(self._walk_low, relaxation)]
        if count > 1:
            ends.append((self._walk_high, relaxation.twin()))
        self._threads = [
            threading.Thread(target=self._guard, args=end, name="frontier-lp-walk", daemon=True) for end in ends
        ]
        for thread in self._threads:
            start_background(thread)

    def _kept_deadlines(self, t_star: float) -> np.ndarray:
        """Anchors up to two past T*: every one over `DENSE_SHARE` of that range, then every
        other one (the last anchor always kept), on grid deadlines but the last (where the
        grid ends)."""
        last = min(self._count - 1, int(np.ceil((t_star - self._t_min) / self._spacing - _EPS)) + 2)
        dense_to = int(round(self.DENSE_SHARE * last))
        index = np.r_[np.arange(dense_to + 1), np.arange(dense_to + 2, last + 1, 2)]
        if index[-1] != last:
            index = np.r_[index, last]
        deadlines = self._t_min + self._spacing * index
        if last == self._count - 1:
            deadlines[-1] = self._t_slowest
        step = self._grid_step(float(deadlines[-1]))
        self.ordinary_end = float(deadlines[-1])
        if self._to_slowest and last < self._count - 1:
            beyond = np.r_[np.arange(last + self._extension_stride, self._count - 1, self._extension_stride),
                           self._count - 1]
            deadlines = np.r_[deadlines, self._t_min + self._spacing * beyond]
            deadlines[-1] = self._t_slowest
        inner = deadlines[:-1]
        # On the grid, but the ordinary end (where the ordinary grid ends) and the last.
        on_grid = np.where(inner == self.ordinary_end, inner, self._t_min + step * np.round((inner - self._t_min) / step))
        on_grid = on_grid[np.r_[True, np.diff(on_grid) > 0]]  # drop repeats (np.unique would
        # import numpy.ma: start-up time)
        return np.r_[on_grid[on_grid < deadlines[-1] - step / 2], deadlines[-1]]

    def _guard(self, walk, relaxation: "ConvexRelaxation") -> None:
        """Run one end of the walk; keep its error for `wait` and stop the other end."""
        try:
            walk(relaxation)
            relaxation.release()  # before `then`: the other end may walk on a while
            if self._then is not None and not self._cancelled:
                self._then(self)
        except BaseException as err:  # raised again in the solver's thread by `wait`
            self._error = self._error or err
            self._cancel()

    def _cancel(self) -> None:
        self._cancelled = True
        self._anchors_known.set()  # a low end waiting for the high end goes on, to stop
        with self.anchor_solved:
            self.anchor_solved.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def deadlines(self) -> np.ndarray:
        """The kept anchors' deadlines (final once either end has finished its anchors)."""
        return self._deadlines

    def anchor_columns(self, first: int, last: int) -> np.ndarray | None:
        """Relaxed durations (N, last - first + 1) of anchors first..last, or None while one of
        them is still being solved."""
        columns = self._columns
        if any(k not in columns for k in range(first, last + 1)):
            return None
        return np.stack([columns[k] for k in range(first, last + 1)], axis=1)

    def _walk_low(self, relaxation: "ConvexRelaxation") -> None:
        self._solve(relaxation, 0)
        self._anchors_known.wait()
        for k in range(1, self._split):
            if not self._solve(relaxation, k):
                return

    def _walk_high(self, relaxation: "ConvexRelaxation") -> None:
        self._t_star = relaxation.min_energy_deadline(self._t_min, self._t_slowest)
        self._free_optimum_j = relaxation.free_optimum_j
        deadlines = self._kept_deadlines(self._t_star)
        meet = self._t_min + self.LOW_END_SHARE * (self.ordinary_end - self._t_min)
        self._deadlines = deadlines
        self._split = max(1, int(np.searchsorted(deadlines, meet)))
        self._anchors_known.set()
        if self._bar is not None:
            self._bar.total = len(deadlines)
            self._bar.refresh()
        for k in range(len(deadlines) - 1, self._split - 1, -1):
            if not self._solve(relaxation, k):
                return

    def _solve(self, relaxation: "ConvexRelaxation", k: int) -> bool:
        """Solve anchor k; False once the walk is cancelled."""
        if self._cancelled:
            return False
        durations = relaxation.durations(float(self._deadlines[k]))
        self._columns[k] = durations  # each end writes its own anchors
        self._optima[k] = relaxation.optimum_j
        with self.anchor_solved:
            self.anchor_solved.notify_all()
        if self._bar is not None:
            self._bar.update()
        return True

    def wait(self) -> np.ndarray:
        """The kept anchors' deadlines, once the walk (and its `then`) has ended; an end's error
        is raised here."""
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
        return self._deadlines

    def lower_bound(self, deadlines: np.ndarray) -> np.ndarray:
        """A lower bound of the energy of every plan meeting each deadline, once the walk has
        ended. The relaxed optimum F is convex in the deadline and falls to its minimum at T*:
        between two anchors, F lies above the chord of the anchors before and of those after
        (extended), and everywhere above its minimum."""
        anchor = self._deadlines
        energy = np.array([self._optima[k] for k in range(len(anchor))])
        capped = np.minimum(deadlines, self._t_star)
        bound = np.full(len(deadlines), -np.inf)
        if len(anchor) > 1:
            slope = np.diff(energy) / np.diff(anchor)  # chord k: anchors k and k + 1
            k = np.clip(np.searchsorted(anchor, capped, side="right") - 1, 0, len(anchor) - 2)
            left = k >= 1  # chord k - 1 extended past anchor k
            bound[left] = energy[k[left]] + slope[k[left] - 1] * (capped[left] - anchor[k[left]])
            right = k + 1 <= len(slope) - 1  # chord k + 1 extended before anchor k + 1
            bound[right] = np.maximum(
                bound[right], energy[k[right] + 1] + slope[k[right] + 1] * (capped[right] - anchor[k[right] + 1])
            )
        at_anchor = np.searchsorted(anchor, capped)
        exact = (at_anchor < len(anchor)) & (anchor[np.minimum(at_anchor, len(anchor) - 1)] == capped)
        bound[exact] = energy[at_anchor[exact]]
        return np.maximum(bound, self._free_optimum_j)

    def close(self) -> None:
        """Stop the walk after the anchors in progress and wait for its threads (the solve
        failed or is done): a thread left inside HiGHS at interpreter exit aborts the process."""
        self._cancel()
        for thread in self._threads:
            thread.join()
        if self._bar is not None:
            self._bar.close()


def interpolate(anchors: np.ndarray, durations: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
    """Relaxed durations at each deadline: the convex combination of the two neighbouring
    anchors' LP solutions, which is feasible for the interpolated deadline."""
    if len(anchors) == 1:
        return np.repeat(durations, len(deadlines), axis=1)
    hi = np.clip(np.searchsorted(anchors, deadlines, side="left"), 1, len(anchors) - 1)
    lo = hi - 1
    weight = np.clip((deadlines - anchors[lo]) / (anchors[hi] - anchors[lo]), 0.0, 1.0)
    return durations[:, lo] * (1 - weight) + durations[:, hi] * weight


