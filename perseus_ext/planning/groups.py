"""Groups of consecutive computations of a stage that run under one clock.

A clock change costs time and disturbs collectives, and some plans must keep a clock across
several computations (a clock-change budget, plans that are safe to replay inside a captured
graph). A `ClockGroups` names such runs: each group is one or more consecutive computations of
one stage, and a plan gives all of them the same SM clock. The exact MILP (`exact.py`) solves
with the groups as constraints of the formulation itself: for every clock f, the group's first
computation runs at f exactly when every other member does. A group whose members share no
clock has no plan and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.schedule import Computation, PipelineSchedule


@dataclass(frozen=True)
class ClockGroups:
    """Runs of consecutive computations of one stage tied to one clock (module docstring)."""

    groups: tuple[tuple[Computation, ...], ...]

    @classmethod
    def of(cls, schedule: PipelineSchedule, groups: Sequence[Sequence[Computation]]) -> "ClockGroups":
        """Checked groups: each one stage's consecutive computations, none in two groups."""
        position = {c: (stage, k) for stage, order in enumerate(schedule.orders) for k, c in enumerate(order)}
        seen: set[Computation] = set()
        checked = []
        for g, group in enumerate(groups):
            group = tuple(group)
            if not group:
                raise ScheduleError(f"clock group {g} is empty; a group holds one or more computations")
            where = []
            for c in group:
                if c not in position:
                    raise ScheduleError(f"clock group {g}: {c} is not a computation of the schedule")
                if c in seen:
                    raise ScheduleError(f"clock group {g}: {c} is already in another group")
                seen.add(c)
                where.append(position[c])
            stages = {stage for stage, _ in where}
            if len(stages) != 1:
                raise ScheduleError(f"clock group {g} spans stages {sorted(stages)}; a group lies on one stage")
            steps = sorted(k for _, k in where)
            if steps != list(range(steps[0], steps[0] + len(steps))):
                raise ScheduleError(
                    f"clock group {g} is not a run of consecutive computations of stage "
                    f"{where[0][0]} (positions {steps})"
                )
            checked.append(tuple(sorted(group, key=lambda c: position[c][1])))
        return cls(tuple(checked))

    @classmethod
    def per_stage(cls, schedule: PipelineSchedule) -> "ClockGroups":
        """One group per stage: one clock for the stage's whole iteration."""
        return cls.of(schedule, [order for order in schedule.orders if order])

    @classmethod
    def runs(cls, schedule: PipelineSchedule, length: int) -> "ClockGroups":
        """Each stage's order cut into runs of `length` consecutive computations (the last
        run of a stage may be shorter)."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ScheduleError(f"a run length must be a positive integer, got {length!r}")
        return cls.of(schedule, [order[k : k + length] for order in schedule.orders
                                 for k in range(0, len(order), length)])

    def node_groups(self, index: dict[Computation, int]) -> list[np.ndarray]:
        """Each group's graph nodes (`PipelineDAG.index`), in stage order."""
        return [np.array([index[c] for c in group], dtype=np.int64) for group in self.groups]

    def holds(self, frequencies_by_node: np.ndarray, index: dict[Computation, int]) -> np.ndarray:
        """Whether each plan (column of a (nodes, plans) clock table) keeps every group at one
        clock."""
        table = np.asarray(frequencies_by_node)
        table = table.reshape(len(table), -1)
        ok = np.ones(table.shape[1], dtype=bool)
        for nodes in self.node_groups(index):
            ok &= (table[nodes] == table[nodes[:1]]).all(axis=0)
        return ok
