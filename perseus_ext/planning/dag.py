"""The computation DAG of one pipeline-parallel training iteration.

Nodes are the computations of a `PipelineSchedule`; edges are (a) each stage's execution order
and (b) the cross-stage data dependencies (a forward needs the previous virtual stage's forward
of the same microbatch, a backward the next virtual stage's backward). Every node has at most
two predecessors and two successors, which lets longest-path passes run level by level over
numpy arrays — for one plan or thousands of plans at once.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule

NO_NODE = -1


def _sort_key(c: Computation) -> tuple[int, int, int, str]:
    return c.stage, c.chunk, c.microbatch, c.kind.value


class PipelineDAG:
    """Computation DAG with nodes numbered in a topological order."""

    def __init__(self, schedule: PipelineSchedule):
        self.schedule = schedule
        # Work on integer ids: hashing a Computation (its Kind enum hashes in Python) dominated
        # building the DAG.
        nodes = [c for order in schedule.orders for c in order]
        ident = {c: i for i, c in enumerate(nodes)}
        n = len(nodes)
        preds: list[list[int]] = [[] for _ in range(n)]  # stage predecessor first, then data
        start = 0
        for order in schedule.orders:
            for i in range(start + 1, start + len(order)):
                preds[i].append(i - 1)
            start += len(order)
        for i, c in enumerate(nodes):
            producer = schedule.producer_of(c)
            if producer is not None:
                preds[i].append(ident[producer])

        # Kahn's algorithm by levels: level = number of edges on the longest path to the node.
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(preds):
            for p in ps:
                succs[p].append(i)
        remaining = [len(ps) for ps in preds]
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
            raise ValueError("schedule has a dependency cycle (deadlock); this is a planner bug")
        order = sorted(range(n), key=lambda i: (depth[i], *_sort_key(nodes[i])))
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)

        self.computations: list[Computation] = [nodes[i] for i in order]
        self.index: dict[Computation, int] = {c: int(position[i]) for c, i in ident.items()}
        self.preds = np.full((n, 2), NO_NODE, dtype=np.int64)
        self.succs = np.full((n, 2), NO_NODE, dtype=np.int64)
        for i in range(n):
            for k, p in enumerate(preds[i]):
                self.preds[position[i], k] = position[p]
            for k, q in enumerate(succs[i]):
                self.succs[position[i], k] = position[q]
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
    def stage_positions(self) -> list[np.ndarray]:
        """Node indices of each stage in that stage's execution order."""
        return [np.array([self.index[c] for c in order]) for order in self.schedule.orders]

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
    def level_preds(self) -> list[tuple[slice, np.ndarray, np.ndarray]]:
        """Per level: (its nodes, their first and second predecessors), for the passes (NO_NODE
        indexes the padding row that sweeps keep after the nodes)."""
        return [(lv, self.preds[lv, 0].copy(), self.preds[lv, 1].copy()) for lv in self.levels]

    @cached_property
    def level_succs(self) -> list[tuple[slice, np.ndarray, np.ndarray]]:
        """Per level: (its nodes, their first and second successors), as `level_preds`."""
        return [(lv, self.succs[lv, 0].copy(), self.succs[lv, 1].copy()) for lv in self.levels]

    @cached_property
    def on_every_path(self) -> np.ndarray:
        """(N,) bool: nodes every path from a first to a last computation passes through, i.e.
        the computations that can never have slack, whatever the clocks.

        In a topological order, node v lies on every such path exactly when no edge jumps over
        it (from before v to after v), no computation after it has no predecessor and none
        before it has no successor (a path that avoids v would need one of the three)."""
        n = len(self)
        has_pred, has_succ = self.preds[:, 0] != NO_NODE, self.succs[:, 0] != NO_NODE
        before, after = np.nonzero(self.preds != NO_NODE)
        tail = self.preds[before, after]
        jumps = np.zeros(n + 1, dtype=np.int64)
        np.add.at(jumps, tail + 1, 1)
        np.add.at(jumps, before, -1)
        jumped = np.cumsum(jumps)[:n] > 0
        index = np.arange(n)
        last_source = int(np.flatnonzero(~has_pred).max())
        first_sink = int(np.flatnonzero(~has_succ).min())
        return ~jumped & (index >= last_source) & (index <= first_sink)

    def edges(self) -> list[tuple[int, int]]:
        return [(int(p), i) for i in range(len(self)) for p in self.preds[i] if p != NO_NODE]

    def finish_times(self, durations: np.ndarray) -> np.ndarray:
        """Earliest finish time of every node; `durations` is (N,) or (N, plans)."""
        durations = np.asarray(durations, dtype=float)
        padded = np.zeros((len(self) + 1,) + durations.shape[1:])  # row -1 is "no node" = 0
        # `take` and `out=`: a third faster than fancy indexing into new arrays, same values.
        for lv, p0, p1 in self.level_preds:
            finish = padded[lv]
            np.maximum(padded.take(p0, axis=0), padded.take(p1, axis=0), out=finish)
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
        for lv, s0, s1 in reversed(self.level_succs):
            np.minimum(latest_start.take(s0, axis=0), latest_start.take(s1, axis=0), out=padded[lv])
            np.subtract(padded[lv], durations[lv], out=latest_start[lv])
        return padded[:-1]

    def to_networkx(self):
        """The DAG as a `networkx.DiGraph` (for inspection and tests)."""
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from(range(len(self)))
        graph.add_edges_from(self.edges())
        return graph
