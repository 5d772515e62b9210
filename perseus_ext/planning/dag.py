"""The computation graph of one pipeline-parallel training iteration, for any schedule.

Nodes are the actions of a `PipelineSchedule` (forwards, backwards, input- and weight-gradient
computations, combined units, gradient syncs); edges are (a) each stage's execution order and
(b) the cross-stage data dependencies `dependencies.py` derives from the actions' kinds and the
schedule's placement. A node may have any number of predecessors and successors: they are kept
as CSR arrays (`pred_ptr`/`pred_idx`, `succ_ptr`/`succ_idx`), one entry per dependency, stage
predecessor first. Longest-path passes run level by level over numpy arrays — for one plan or
thousands of plans at once — gathering each level's predecessors slot by slot
(`level_preds[l] = (nodes, slots)`, slot k holding each node's k-th predecessor or NO_NODE).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.dependencies import ScheduleIndex
from perseus_ext.planning.schedule import Computation, PipelineSchedule

NO_NODE = -1


def _sort_key(c: Computation) -> tuple:
    return c.stage, c.chunk, c.microbatch, c.kind.value, c.parts


def _renumber(ptr: np.ndarray, idx: np.ndarray, order: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """CSR rows taken in `order` (rows keep their entries' order)."""
    order = np.asarray(order, dtype=np.int64)
    counts = np.diff(ptr)[order]
    new_ptr = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_ptr[1:])
    starts = np.repeat(ptr[:-1][order] - new_ptr[:-1], counts)
    return new_ptr, idx[np.arange(int(new_ptr[-1])) + starts]


def _slots(ptr: np.ndarray, idx: np.ndarray, nodes: slice) -> tuple[np.ndarray, ...]:
    """A level's neighbours as slot arrays: slot k = each node's k-th neighbour or NO_NODE
    (at least one slot, so a level of sources still gathers the padding row)."""
    start, stop = ptr[nodes.start : nodes.stop], ptr[nodes.start + 1 : nodes.stop + 1]
    degree = stop - start
    width = max(1, int(degree.max()) if len(degree) else 1)
    return tuple(
        np.where(degree > k, idx[np.minimum(start + k, len(idx) - 1)] if len(idx) else NO_NODE, NO_NODE)
        for k in range(width)
    )


def _gather(reduce: np.ufunc, table: np.ndarray, slots: tuple[np.ndarray, ...],
            out: np.ndarray | None) -> np.ndarray:
    """`reduce` (np.maximum or np.minimum) of `table`'s rows over a level's slots."""
    if len(slots) == 1:
        if out is None:
            return table.take(slots[0], axis=0)
        out[...] = table.take(slots[0], axis=0)
        return out
    out = reduce(table.take(slots[0], axis=0), table.take(slots[1], axis=0), out=out)
    for extra in slots[2:]:
        reduce(out, table.take(extra, axis=0), out=out)
    return out


def gather_max(table: np.ndarray, slots: tuple[np.ndarray, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Row-wise maximum of `table` over a level's slots (`out` may be the level's rows)."""
    return _gather(np.maximum, table, slots, out)


def gather_min(table: np.ndarray, slots: tuple[np.ndarray, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Row-wise minimum of `table` over a level's slots (`gather_max`'s mirror)."""
    return _gather(np.minimum, table, slots, out)


class PipelineDAG:
    """Computation DAG with nodes numbered in a topological order (by longest-path level, then
    stage, chunk, microbatch, kind)."""

    def __init__(self, schedule: PipelineSchedule):
        self.schedule = schedule
        index = ScheduleIndex(schedule)
        index.check()
        data_node, data_producer = index.data_edges()
        nodes = index.actions
        n = len(nodes)
        # Edges as (node, producer): each stage's order first, then the data dependencies in
        # the order of the node's parts (a stable sort by node keeps both orders).
        first = np.zeros(n, dtype=bool)
        first[np.cumsum([0] + [len(order) for order in schedule.orders[:-1]])] = True
        chained = np.flatnonzero(~first)
        heads = np.concatenate([chained, data_node])
        tails = np.concatenate([chained - 1, data_producer])
        by_node = np.argsort(heads, kind="stable")
        heads, tails = heads[by_node], tails[by_node]
        pred_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(heads, minlength=n), out=pred_ptr[1:])
        by_tail = np.argsort(tails, kind="stable")
        succ_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(tails, minlength=n), out=succ_ptr[1:])
        succ_heads = heads[by_tail]

        # Kahn's algorithm by levels: level = number of edges on the longest path to the node.
        succs = [succ_heads[a:b] for a, b in zip(succ_ptr[:-1].tolist(), succ_ptr[1:].tolist())]
        succs = [x.tolist() for x in succs]
        remaining = np.diff(pred_ptr).tolist()
        depth = [0] * n
        frontier = [i for i in range(n) if not remaining[i]]
        reached = 0
        while frontier:
            reached += len(frontier)
            nxt = []
            for i in frontier:
                for j in succs[i]:
                    remaining[j] -= 1
                    if not remaining[j]:
                        depth[j] = depth[i] + 1
                        nxt.append(j)
            frontier = nxt
        if reached != n:
            stuck = [str(nodes[i]) for i in range(n) if remaining[i]][:6]
            raise ScheduleError(
                f"the schedule deadlocks: its stage orders and data dependencies form a cycle "
                f"through {', '.join(stuck)}"
            )
        order = sorted(range(n), key=lambda i: (depth[i], *_sort_key(nodes[i])))
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)

        self.computations: list[Computation] = [nodes[i] for i in order]
        self.index: dict[Computation, int] = dict(zip(nodes, position.tolist()))
        # Renumber: node k of the new order is old node order[k]; its edges keep their order.
        self.pred_ptr, self.pred_idx = _renumber(pred_ptr, position[tails], order)
        self.succ_ptr, self.succ_idx = _renumber(succ_ptr, position[succ_heads], order)
        self.stage = np.array([c.stage for c in self.computations], dtype=np.int64)
        self.level = np.array(depth, dtype=np.int64)[order]
        bounds = np.flatnonzero(np.diff(self.level)) + 1
        self.levels: list[slice] = [
            slice(int(a), int(b)) for a, b in zip(np.r_[0, bounds], np.r_[bounds, n])
        ]

    def __len__(self) -> int:
        return len(self.computations)

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @cached_property
    def in_degree(self) -> np.ndarray:
        return np.diff(self.pred_ptr)

    @cached_property
    def out_degree(self) -> np.ndarray:
        return np.diff(self.succ_ptr)

    def predecessors(self, node: int) -> np.ndarray:
        """Node `node`'s predecessors, one per dependency, its stage predecessor first."""
        return self.pred_idx[self.pred_ptr[node] : self.pred_ptr[node + 1]]

    def successors(self, node: int) -> np.ndarray:
        return self.succ_idx[self.succ_ptr[node] : self.succ_ptr[node + 1]]

    @cached_property
    def pred_matrix(self) -> np.ndarray:
        """(N, max in-degree) predecessors padded with NO_NODE (at least one column)."""
        return self._padded(self.pred_ptr, self.pred_idx)

    def _padded(self, ptr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return np.stack(_slots(ptr, idx, slice(0, len(self))), axis=1)

    @cached_property
    def stage_positions(self) -> list[np.ndarray]:
        """Node indices of each stage in that stage's execution order."""
        return [np.array([self.index[c] for c in order], dtype=np.int64) for order in self.schedule.orders]

    @cached_property
    def stage_prev(self) -> np.ndarray:
        """Node run just before each node on its stage (NO_NODE for a stage's first)."""
        prev = np.full(len(self), NO_NODE, dtype=np.int64)
        for pos in self.stage_positions:
            prev[pos[1:]] = pos[:-1]
        return prev

    @cached_property
    def stage_next(self) -> np.ndarray:
        """Node run just after each node on its stage (NO_NODE for a stage's last)."""
        nxt = np.full(len(self), NO_NODE, dtype=np.int64)
        for pos in self.stage_positions:
            nxt[pos[:-1]] = pos[1:]
        return nxt

    @cached_property
    def level_preds(self) -> list[tuple[slice, tuple[np.ndarray, ...]]]:
        """Per level: (its nodes, their predecessors slot by slot), for the passes (NO_NODE
        indexes the padding row that sweeps keep after the nodes)."""
        return [(lv, _slots(self.pred_ptr, self.pred_idx, lv)) for lv in self.levels]

    @cached_property
    def level_succs(self) -> list[tuple[slice, tuple[np.ndarray, ...]]]:
        """Per level: (its nodes, their successors slot by slot), as `level_preds`."""
        return [(lv, _slots(self.succ_ptr, self.succ_idx, lv)) for lv in self.levels]

    @cached_property
    def on_every_path(self) -> np.ndarray:
        """(N,) bool: nodes every path from a first to a last computation passes through, i.e.
        the computations that can never have slack, whatever the clocks.

        In a topological order, node v lies on every such path exactly when no edge jumps over
        it (from before v to after v), no computation after it has no predecessor and none
        before it has no successor (a path that avoids v would need one of the three)."""
        n = len(self)
        has_pred, has_succ = self.in_degree > 0, self.out_degree > 0
        before = np.repeat(np.arange(n), self.in_degree)
        tail = self.pred_idx
        jumps = np.zeros(n + 1, dtype=np.int64)
        np.add.at(jumps, tail + 1, 1)
        np.add.at(jumps, before, -1)
        jumped = np.cumsum(jumps)[:n] > 0
        index = np.arange(n)
        last_source = int(np.flatnonzero(~has_pred).max())
        first_sink = int(np.flatnonzero(~has_succ).min())
        return ~jumped & (index >= last_source) & (index <= first_sink)

    def edges(self) -> list[tuple[int, int]]:
        """(predecessor, node) per dependency, node by node, stage predecessor first."""
        heads = np.repeat(np.arange(len(self)), self.in_degree)
        return list(zip(self.pred_idx.tolist(), heads.tolist()))

    def finish_times(self, durations: np.ndarray) -> np.ndarray:
        """Earliest finish time of every node; `durations` is (N,) or (N, plans)."""
        durations = np.asarray(durations, dtype=float)
        padded = np.zeros((len(self) + 1,) + durations.shape[1:])  # row -1 is "no node" = 0
        # `take` and `out=`: no new arrays per level (fancy indexing would allocate them).
        for lv, slots in self.level_preds:
            finish = padded[lv]
            gather_max(padded, slots, out=finish)
            finish += durations[lv]
        return padded[:-1]

    def makespan(self, durations: np.ndarray) -> np.ndarray | float:
        """Iteration time: the longest path through the DAG."""
        return self.finish_times(durations).max(axis=0)

    def latest_finish_times(self, durations: np.ndarray, deadline: np.ndarray | float) -> np.ndarray:
        """Latest finish time of every node that still meets `deadline` (per plan)."""
        durations = np.asarray(durations, dtype=float)
        padded = np.empty((len(self) + 1,) + durations.shape[1:])
        padded[-1] = np.asarray(deadline) + 0.0  # "no successor": bounded by the deadline
        latest_start = np.empty_like(padded)
        latest_start[-1] = padded[-1]
        for lv, slots in reversed(self.level_succs):
            gather_min(latest_start, slots, out=padded[lv])
            np.subtract(padded[lv], durations[lv], out=latest_start[lv])
        return padded[:-1]

    def to_networkx(self):
        """The DAG as a `networkx.DiGraph` (for inspection and tests)."""
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from(range(len(self)))
        graph.add_edges_from(self.edges())
        return graph
