"""Step 1 of the frontier solver (`solver.py`): the convex relaxation at anchor deadlines.

Each computation's cost c_i(t) = e_i(t) - P_block t is replaced by the lower convex hull of its
profiled (time, cost) points; the problem becomes an LP over start times and hull-segment fills,
solved exactly with HiGHS and warm-started from one anchor deadline to the next. Between
anchors, the convex combination of the two neighbouring LP solutions is feasible for the
interpolated deadline (the constraints are linear), so every grid deadline gets a relaxed plan
in O(N) (`interpolate`).
"""

from __future__ import annotations

import threading

import highspy
import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel

_EPS = 1e-9


class ConvexRelaxation:
    """The LP over start times and convex-hull segment fills, kept warm across deadlines."""

    def __init__(self, model: CostModel):
        self.model = model
        dag = model.dag
        n = len(dag)
        p = model.blocking_power
        # Lower convex hull of (time, cost) per node; nodes sharing options share hulls.
        seg_node, seg_len, seg_slope = [], [], []
        cache: dict[bytes, np.ndarray] = {}
        for i in range(n):
            k = model.num_options[i]
            t = model.times[i, :k]
            c = model.energies[i, :k] - p * t
            key = t.tobytes() + c.tobytes()
            if key not in cache:
                cache[key] = lower_hull(t, c)
            hull = cache[key]
            ht, hc = t[hull], c[hull]
            for j in range(len(hull) - 1):
                seg_node.append(i)
                seg_len.append(ht[j + 1] - ht[j])
                seg_slope.append((hc[j + 1] - hc[j]) / (ht[j + 1] - ht[j]))
        self.seg_node = np.array(seg_node, dtype=np.int64)
        self.seg_len = np.array(seg_len)
        seg_slope = np.array(seg_slope)
        self.t_min = model.times[:, 0].copy()
        self.base_cost = float((model.energies[:, 0] - p * self.t_min).sum())  # all fastest
        m = len(seg_node)

        # Variables: [start_0..start_{n-1}, fill_0..fill_{m-1}, T]. Every row says "node a
        # finishes before b starts" (b a successor's start, or T for a sink):
        #   start_a + sum fills(a) - x_b <= -t_min_a
        t_col = n + m
        fills_of = [[] for _ in range(n)]
        for s, node in enumerate(seg_node):
            fills_of[node].append(n + s)
        rows, cols, vals, rhs = [], [], [], []
        sinks = np.flatnonzero((dag.succs == -1).all(axis=1))
        for r, (node, later) in enumerate([*dag.edges(), *((int(i), t_col) for i in sinks)]):
            row_cols = [node, later, *fills_of[node]]
            rows += [r] * len(row_cols)
            cols += row_cols
            vals += [1.0, -1.0] + [1.0] * len(fills_of[node])
            rhs.append(-self.t_min[node])
        r = len(rhs)
        start, index, value = csc_matrix(np.array(rows), np.array(cols), np.array(vals, dtype=float), n + m + 1)

        lp = highspy.HighsLp()
        lp.num_col_ = n + m + 1
        lp.num_row_ = r
        lp.col_cost_ = np.concatenate([np.zeros(n), seg_slope, [0.0]])
        lp.col_lower_ = np.zeros(n + m + 1)
        lp.col_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), self.seg_len, [0.0]])
        lp.row_lower_ = np.full(r, -highspy.kHighsInf)
        lp.row_upper_ = np.array(rhs)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("solver", "simplex")
        self.highs.passModel(lp)
        self.t_col = t_col
        self.n, self.m = n, m

    def energy(self, deadline: float) -> float:
        """Relaxed minimum energy at `deadline` (after `durations` solved it)."""
        objective = self.highs.getInfo().objective_function_value
        return self.base_cost + objective + self.model.blocking_power * self.model.num_stage_gpus * deadline

    def durations(self, deadline: float) -> np.ndarray:
        """Relaxed optimal durations at `deadline` (warm-started from the previous solve)."""
        h = self.highs
        h.changeColBounds(self.t_col, deadline, deadline)
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"LP relaxation at T={deadline:.6f}s ended with {h.modelStatusToString(status)}")
        x = np.asarray(h.getSolution().col_value)
        fills = np.clip(x[self.n : self.n + self.m], 0.0, self.seg_len)
        return self.t_min + np.bincount(self.seg_node, weights=fills, minlength=self.n)


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
    """The LP walk over `count` evenly spaced anchor deadlines from T_min to `t_slowest` (all
    clocks slowest), on a background thread.

    HiGHS releases the GIL while it solves, so the solver rounds the deadlines the walk has
    passed (`wait`) while later anchors are solved. The walk stops once the relaxed energy has
    risen at two anchors past its minimum: slower than the minimum-energy plan, energy only
    grows (blocking power outweighs what slower clocks save), so deadlines there are not worth
    planning. `progress` shows a tqdm bar.
    """

    def __init__(self, model: CostModel, count: int, t_min: float, t_slowest: float, progress: bool = False):
        if t_slowest - t_min < _EPS:  # slower clocks save no time: a single deadline
            count = 1
        self._deadlines = np.empty(count)
        self._durations = np.empty((model.num_nodes, count))
        self._solved = 0  # anchors solved so far (columns of `_durations`)
        self._finished = self._cancelled = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._walk, args=(model, count, t_min, t_slowest, progress), name="frontier-lp-walk",
            daemon=True,
        )
        self._thread.start()

    def _walk(self, model: CostModel, count: int, t_min: float, t_slowest: float, progress: bool) -> None:
        bar = None
        try:
            relaxation = ConvexRelaxation(model)
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=count, desc="frontier LP anchors", unit="anchor")
            spacing = (t_slowest - t_min) / max(count - 1, 1)
            energies: list[float] = []
            for k in range(count):
                if self._cancelled:
                    break
                deadline = t_min + k * spacing if k < count - 1 else max(t_slowest, t_min)
                self._durations[:, k] = relaxation.durations(deadline)
                self._deadlines[k] = deadline
                energies.append(relaxation.energy(deadline))
                with self._changed:
                    self._solved = k + 1
                    self._changed.notify_all()
                if bar is not None:
                    bar.update()
                if k >= 2 and min(energies[-2:]) > min(energies):
                    break
        except BaseException as err:  # raised again in the solver's thread by `result`
            self._error = err
        finally:
            if bar is not None:
                bar.close()
            with self._changed:
                self._finished = True
                self._changed.notify_all()

    def wait(self, solved: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """Block until more than `solved` anchors are solved or the walk has ended; return the
        anchors so far (deadlines, durations (N, anchors); views) and whether it has ended."""
        with self._changed:
            self._changed.wait_for(lambda: self._solved > solved or self._finished)
            k, finished = self._solved, self._finished
        return self._deadlines[:k], self._durations[:, :k], finished

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Every anchor: (deadlines, relaxed durations (N, anchors)), once the walk has ended."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._deadlines[: self._solved], self._durations[:, : self._solved]

    def close(self) -> None:
        """Stop the walk after the anchor in progress (the solve failed or is done)."""
        self._cancelled = True


def interpolate(anchors: np.ndarray, durations: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
    """Relaxed durations at each deadline: the convex combination of the two neighbouring
    anchors' LP solutions, which is feasible for the interpolated deadline."""
    if len(anchors) == 1:
        return np.repeat(durations, len(deadlines), axis=1)
    hi = np.clip(np.searchsorted(anchors, deadlines, side="left"), 1, len(anchors) - 1)
    lo = hi - 1
    weight = np.clip((deadlines - anchors[lo]) / (anchors[hi] - anchors[lo]), 0.0, 1.0)
    return durations[:, lo] * (1 - weight) + durations[:, hi] * weight


