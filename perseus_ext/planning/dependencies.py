"""The dependency rules of a pipeline iteration, for every schedule: the one place they live.

A schedule (`schedule.py`) says what each stage runs and in which order, and where each virtual
stage sits. What a computation needs from the others follows from its kind alone:

- a forward of virtual stage v needs the forward of v - 1 (same microbatch); the first virtual
  stage's reads the data loader;
- a backward or an input-gradient computation of v needs the input gradient of v + 1 (the
  backward or input-gradient computation of v + 1), or at the last virtual stage the loss, i.e.
  that stage's own forward;
- a weight-gradient computation needs its own input-gradient computation, a backward or
  input-gradient computation its own forward, a gradient sync every gradient computation of
  its chunk: all on the same stage, so the stage's order must already put them first (checked,
  not an edge);
- a combined unit needs what its parts need from outside it, and whoever needs one of its parts
  waits for the whole unit.

`ScheduleIndex` applies the rules to a whole schedule at once, on integer keys (virtual stage,
microbatch, kind) in numpy arrays, so building the graph of a 16,000-computation iteration
costs milliseconds: `data_edges` gives the graph's cross-virtual-stage edges (`dag.py` adds each
stage's order) and `check` refuses action lists that could not run.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.actions import Computation, Kind


class ScheduleShape(Protocol):
    """What the rules read of a `schedule.PipelineSchedule` (which imports this module)."""

    num_stages: int
    num_microbatches: int
    orders: tuple[tuple[Computation, ...], ...]
    placement: tuple[tuple[int, int], ...]

    @property
    def num_virtual_stages(self) -> int: ...

    def virtual_stage(self, c: Computation) -> int: ...

    def at(self, virtual_stage: int, microbatch: int, kind: Kind) -> Computation: ...

_KINDS = tuple(Kind)
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
F, B, I, W, R = (_CODE[k] for k in (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRADIENT,
                                    Kind.WEIGHT_GRADIENT, Kind.REDUCE_GRAD))
NUM_KINDS = len(_KINDS)
MISSING = -1


class ScheduleIndex:
    """Every single computation (unit) of a schedule: the action (graph node, numbered in the
    flattened stage orders) that runs it, that action's position on its stage, and a table from
    (virtual stage, microbatch, kind) to the unit."""

    def __init__(self, schedule: ScheduleShape):
        self.schedule = schedule
        actions = [a for order in schedule.orders for a in order]
        self.actions = actions
        plain = all(a.kind is not Kind.COMBINED for a in actions)
        if plain:
            units = actions
            owner = np.arange(len(actions), dtype=np.int64)
        else:
            units, owners = [], []
            for node, action in enumerate(actions):
                for unit in action.units:
                    units.append(unit)
                    owners.append(node)
            owner = np.array(owners, dtype=np.int64)
        self.units = units
        self.owner = owner
        positions = np.concatenate([np.arange(len(order)) for order in schedule.orders]) if actions else np.zeros(0)
        self.position = positions.astype(np.int64)[owner]
        fields = np.array([(u.stage, u.chunk, u.microbatch, _CODE[u.kind]) for u in units], dtype=np.int64)
        fields = fields.reshape(-1, 4)
        stage, chunk, microbatch, kind = fields.T
        self.kind, self.microbatch = kind, microbatch
        where = np.full((schedule.num_stages, 1 + max([c for _, c in schedule.placement] + [int(chunk.max(initial=0))])),
                        MISSING, dtype=np.int64)
        for v, (s, c) in enumerate(schedule.placement):
            where[s, c] = v
        self.virtual = where[stage, chunk]
        unplaced = np.flatnonzero(self.virtual == MISSING)
        if unplaced.size:
            u = units[int(unplaced[0])]
            raise ScheduleError(
                f"{u} runs chunk {u.chunk} of stage {u.stage}, which the schedule's placement does not hold")
        self.microbatches = schedule.num_microbatches
        work = kind != R
        bad = np.flatnonzero(work & ((microbatch < 0) | (microbatch >= self.microbatches)))
        if bad.size:
            raise ScheduleError(f"{units[int(bad[0])]}: microbatch outside 0..{self.microbatches - 1}")
        self.key = np.where(work, self.key_of(self.virtual, microbatch, kind), MISSING)
        self.table = np.full(schedule.num_virtual_stages * self.microbatches * NUM_KINDS, MISSING, dtype=np.int64)
        work_units = np.flatnonzero(work)
        keys = self.key[work_units]
        counts = np.bincount(keys, minlength=len(self.table))
        if (counts > 1).any():
            twice = work_units[np.flatnonzero(counts[keys] > 1)[0]]
            raise ScheduleError(f"{units[int(twice)]} runs twice in the schedule")
        self.table[keys] = work_units

    def key_of(self, virtual: np.ndarray, microbatch: np.ndarray, kind: np.ndarray | int) -> np.ndarray:
        return (virtual * self.microbatches + microbatch) * NUM_KINDS + kind

    def _unit(self, virtual: np.ndarray, microbatch: np.ndarray, kind: np.ndarray | int) -> np.ndarray:
        return self.table[self.key_of(virtual, microbatch, kind)]

    def _at(self, virtual: int, microbatch: int, kind: int) -> Computation:
        return self.schedule.at(int(virtual), int(microbatch), _KINDS[kind])

    def needed_units(self) -> tuple[np.ndarray, np.ndarray]:
        """(needer, needed) unit pairs across virtual stages, by needer (module docstring)."""
        v, m, kind = self.virtual, self.microbatch, self.kind
        last = self.schedule.num_virtual_stages - 1
        forward = np.flatnonzero((kind == F) & (v > 0))
        gradient = np.flatnonzero((kind == B) | (kind == I))
        at_loss = gradient[v[gradient] == last]
        inner = gradient[v[gradient] < last]
        split = self._unit(v[inner] + 1, m[inner], I)
        full = self._unit(v[inner] + 1, m[inner], B)
        needer = np.concatenate([forward, at_loss, inner])
        needed = np.concatenate([
            self._unit(v[forward] - 1, m[forward], F),
            self._unit(v[at_loss], m[at_loss], F),
            np.where(split != MISSING, split, full),
        ])
        missing = np.flatnonzero(needed == MISSING)
        if missing.size:
            u = int(needer[missing[0]])
            unit = self.units[u]
            if unit.kind is Kind.FORWARD:
                want = str(self._at(v[u] - 1, m[u], F))
            elif v[u] == last:
                want = str(self._at(v[u], m[u], F))
            else:
                want = f"the input gradient of microbatch {m[u]} on virtual stage {v[u] + 1}"
            raise ScheduleError(f"{unit} needs {want}, which no stage of the schedule runs")
        order = np.argsort(needer, kind="stable")
        return needer[order], needed[order]

    def data_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(node, producer node) per cross-virtual-stage dependency, node by node in the order
        of its parts; a dependency inside a combined unit is none."""
        needer, needed = self.needed_units()
        node, producer = self.owner[needer], self.owner[needed]
        keep = node != producer
        return node[keep], producer[keep]

    def check(self) -> None:
        """Refuse an action list that cannot run as listed (`ScheduleError` naming the action):
        every virtual stage runs each microbatch's forward once and its gradient once (a
        backward, or an input-gradient and a weight-gradient computation), and every same-stage
        prerequisite comes earlier in that stage's order. Cross-stage inputs are checked by
        `data_edges` (a missing one) and when the graph is built (a cycle)."""
        schedule = self.schedule
        kind, v, m = self.kind, self.virtual, self.microbatch
        # Same-stage prerequisites: B/I after their forward, W after its input gradient.
        for mask, need in (((kind == B) | (kind == I), F), (kind == W, I)):
            units = np.flatnonzero(mask)
            before = self._unit(v[units], m[units], need)
            absent = np.flatnonzero(before == MISSING)
            if absent.size:
                u = int(units[absent[0]])
                raise ScheduleError(f"{self.units[u]} needs {self._at(v[u], m[u], need)}, which no stage of the schedule runs")
            late = np.flatnonzero((self.owner[before] != self.owner[units]) & (self.position[before] >= self.position[units]))
            if late.size:
                u, p = int(units[late[0]]), int(before[late[0]])
                raise ScheduleError(f"stage {self.units[u].stage} runs {self.units[u]} before {self.units[p]}, which it needs")
        grid = self.table.reshape(schedule.num_virtual_stages, self.microbatches, NUM_KINDS)
        has = grid != MISSING
        no_forward = np.argwhere(~has[:, :, F])
        if len(no_forward):
            vs, mb = no_forward[0]
            raise ScheduleError(f"no stage runs the forward of microbatch {mb} on virtual stage {vs}")
        both = has[:, :, B] == has[:, :, I]
        if both.any():
            vs, mb = np.argwhere(both)[0]
            raise ScheduleError(
                f"microbatch {mb} on virtual stage {vs} needs exactly one backward, or one "
                f"input-gradient and one weight-gradient computation; the schedule runs "
                f"{'both' if has[vs, mb, B] else 'neither'}"
            )
        lonely = np.argwhere(has[:, :, I] & ~has[:, :, W])
        if len(lonely):
            vs, mb = lonely[0]
            raise ScheduleError(
                f"microbatch {mb} on virtual stage {vs} has an input-gradient computation but no "
                f"weight-gradient one"
            )
        for r in np.flatnonzero(kind == R).tolist():  # a sync after every gradient of its chunk
            gradients = grid[v[r], :, [B, W]].ravel()
            gradients = gradients[gradients != MISSING]
            late = gradients[self.position[gradients] >= self.position[r]]
            if late.size:
                raise ScheduleError(
                    f"stage {self.units[r].stage} syncs gradients ({self.units[r]}) before "
                    f"{self.actions[int(self.owner[late[0]])]}")


def data_inputs(schedule: ScheduleShape, action: Computation) -> tuple[Computation, ...]:
    """The actions whose outputs `action` consumes from another virtual stage, in the order of
    its parts (the rules of the module docstring, for one action)."""
    index = schedule.__dict__.get("_dependency_index")
    if index is None:
        index = ScheduleIndex(schedule)
        object.__setattr__(schedule, "_dependency_index", index)
    inputs = []
    for unit in action.units:
        if unit.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRADIENT):
            continue
        v, m = schedule.virtual_stage(unit), unit.microbatch
        if unit.kind is Kind.FORWARD:
            found = index._unit(np.int64(v - 1), np.int64(m), F) if v > 0 else None
        elif v == schedule.num_virtual_stages - 1:
            found = index._unit(np.int64(v), np.int64(m), F)
        else:
            split = index._unit(np.int64(v + 1), np.int64(m), I)
            found = split if split != MISSING else index._unit(np.int64(v + 1), np.int64(m), B)
        if found is None:
            continue
        if found == MISSING:
            raise ScheduleError(f"{unit} needs an output no stage of the schedule computes")
        source = index.actions[int(index.owner[found])]
        if source != action:
            inputs.append(source)
    return tuple(inputs)


def check_schedule(schedule: ScheduleShape) -> None:
    """`ScheduleIndex(schedule).check()` and its cross-stage inputs: what `schedule_from_actions`
    runs before it returns."""
    index = ScheduleIndex(schedule)
    index.check()
    index.data_edges()
