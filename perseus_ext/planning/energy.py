"""The energy model: what a plan costs when replayed on the profile.

A plan picks one clock per computation. Its iteration time T is the DAG's longest path with
the profiled times; its energy is the profiled energy of every computation at its clock plus
P_block x (T - busy time) for every stage, P_block being the GPU's power while it waits on
communication. Equivalently energy = sum(e_i - P_block t_i) + P_block S T, which is what the
solver minimises at each T.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from perseus_ext.errors import ProfileError
from perseus_ext.planning.dag import PipelineDAG
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule

BLOCKING_POWER_W = {"a100": 83.64, "a40": 70.38}  # published, Perseus artifact


class CostModel:
    """Per-computation clock options as dense arrays, fastest option first.

    Option k of node i has `times[i, k]`, `energies[i, k]`, `frequencies[i, k]`; nodes with
    fewer options are padded with +inf time (never chosen). Choices are option indices.
    """

    def __init__(self, schedule: PipelineSchedule, profile: Profile, blocking_power: float):
        if not np.isfinite(blocking_power) or blocking_power < 0:
            raise ProfileError(
                f"blocking power must be a non-negative number of watts, got {blocking_power!r}"
            )
        self.dag = PipelineDAG(schedule)
        self.blocking_power = float(blocking_power)
        chunks = schedule.num_chunks
        if profile.num_stages == schedule.num_virtual_stages:
            per_virtual_stage, scale = True, 1.0
        elif profile.num_stages == schedule.num_stages:
            # A per-GPU profile: each of the V chunks holds 1/V of the stage's layers.
            per_virtual_stage, scale = False, 1.0 / chunks
        else:
            raise ProfileError(
                f"{profile.source} has {profile.num_stages} stages but the schedule has "
                f"{schedule.num_stages} stages x {chunks} virtual stages; profile every stage "
                f"(or every virtual stage) of this pipeline"
            )
        options = []
        for c in self.dag.computations:
            stage = schedule.virtual_stage(c) if per_virtual_stage else c.stage
            options.append(profile[stage, c.kind.value])
        width = max(len(op) for op in options)
        n = len(options)
        self.num_options = np.array([len(op) for op in options])
        self.times = np.full((n, width), np.inf)
        self.energies = np.full((n, width), np.inf)
        self.frequencies = np.zeros((n, width), dtype=np.int64)
        for i, op in enumerate(options):
            k = len(op)
            self.times[i, :k] = op.times * scale
            self.energies[i, :k] = op.energies * scale
            self.frequencies[i, :k] = op.frequencies
        self.schedule = schedule

    @cached_property
    def option_times(self) -> list[np.ndarray]:
        """Each node's option times, fastest first, without padding (for `np.searchsorted`)."""
        return [self.times[i, :k] for i, k in enumerate(self.num_options)]

    @property
    def num_nodes(self) -> int:
        return len(self.dag)

    def fastest_choice(self) -> np.ndarray:
        return np.zeros(self.num_nodes, dtype=np.int64)

    def min_energy_choice(self) -> np.ndarray:
        return np.argmin(self.energies, axis=1)

    def _take(self, table: np.ndarray, choice: np.ndarray) -> np.ndarray:
        rows = np.arange(self.num_nodes).reshape((-1,) + (1,) * (choice.ndim - 1))
        return table[rows, choice]

    def replay(self, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(iteration time, energy) of choices shaped (N,) or (N, plans)."""
        choice = np.asarray(choice)
        durations = self._take(self.times, choice)
        makespan = self.dag.makespan(durations)
        compute = self._take(self.energies, choice).sum(axis=0)
        idle = self.num_stage_gpus * makespan - durations.sum(axis=0)
        return makespan, compute + self.blocking_power * idle

    @property
    def num_stage_gpus(self) -> int:
        return self.schedule.num_stages

    def to_plan(self, choice: np.ndarray) -> Plan:
        """A `Plan` whose time and energy come from replaying exactly these clocks."""
        choice = np.asarray(choice)
        time, energy = self.replay(choice)
        return self.make_plans(choice[:, None], [time], [energy])[0]

    def make_plans(self, choices: np.ndarray, times: np.ndarray, energies: np.ndarray) -> list[Plan]:
        """`Plan`s from choices (N, plans) whose replayed times and energies the caller has.

        All plans share one read-only (plans, stages, computations) clock array.
        """
        freqs = np.take_along_axis(self.frequencies, np.asarray(choices), axis=1)
        table = np.ascontiguousarray(
            np.stack([freqs[pos] for pos in self.dag.stage_positions]).transpose(2, 0, 1),
            dtype=np.int32,
        )
        table.flags.writeable = False
        return [Plan(float(t), float(e), table[j]) for j, (t, e) in enumerate(zip(times, energies))]

    def choice_of(self, plan: Plan) -> np.ndarray:
        """Option indices of a plan's clocks (inverse of `to_plan`)."""
        choice = np.empty(self.num_nodes, dtype=np.int64)
        for stage, pos in enumerate(self.dag.stage_positions):
            row = plan.frequencies[stage]
            if len(row) != len(pos):
                raise ProfileError(
                    f"plan has {len(row)} clocks for stage {stage}, the schedule {len(pos)}"
                )
            for node, freq in zip(pos, row):
                hits = np.flatnonzero(self.frequencies[node, : self.num_options[node]] == freq)
                if not hits.size:
                    raise ProfileError(f"plan clock {freq} MHz is not in stage {stage}'s profile")
                choice[node] = hits[0]
        return choice
