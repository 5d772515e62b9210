"""The energy model: what a plan costs when replayed on the profile.

A plan picks one clock per computation. Its iteration time T is the DAG's longest path with
the profiled times; its energy is the profiled energy of every computation at its clock plus
P_block x (T - busy time) for every stage, P_block being the GPU's power while it waits on
communication. Equivalently energy = sum(e_i - P_block t_i) + P_block S T, which is what the
solver minimises at each T.

Clock changes take effect late (`switch_latency_s`, L). On each stage the runtime requests
computation k's clock when computation k-1 ends (the first computation's at iteration start,
t = 0, with the stage's fastest clock in force before it). So computation k, starting at s_k,
still runs at the previous clock for tau = clamp(e_{k-1} + L - s_k, 0, t_k(prev)) seconds and
does the rest of its work at its own clock:
    duration = tau + (1 - tau / t_k(prev)) t_k(own),
    energy   = tau / t_k(prev) e_k(prev) + (1 - tau / t_k(prev)) e_k(own),
t_k(c), e_k(c) being computation k's profiled time and energy at clock c. Starts come from the
same longest-path pass, so a latency-aware replay is still one topological pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from perseus_ext.errors import ConfigError, ProfileError
from perseus_ext.planning.dag import PipelineDAG, gather_max
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.profile import OperatingPoints, Profile, pareto_indices
from perseus_ext.planning.schedule import PipelineSchedule

BLOCKING_POWER_W = {"a100": 83.64, "a40": 70.38}  # published, Perseus artifact


def resolve_blocking_power(value: str | float) -> float:
    """Watts one GPU draws while blocked on communication: a number, or a GPU name
    with a published value (`a100`, `a40`)."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in BLOCKING_POWER_W:
            return BLOCKING_POWER_W[key]
        try:
            value = float(key)
        except ValueError:
            names = ", ".join(sorted(BLOCKING_POWER_W))
            raise ConfigError(
                f"blocking power {value!r} is neither a number of watts nor a known GPU ({names})"
            ) from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"blocking power must be a finite number of watts >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LatencyTrace:
    """Per-node result of a latency-aware replay, shaped (N,) or (N, plans)."""

    finish: np.ndarray  # seconds from iteration start
    durations: np.ndarray  # seconds, switch penalty included
    node_energies: np.ndarray  # joules
    carried: np.ndarray  # option (in the node's own table) of the clock still in force at start


class CostModel:
    """Per-computation clock options as dense arrays, fastest option first.

    Option k of node i has `times[i, k]`, `energies[i, k]`, `frequencies[i, k]`; nodes with
    fewer options are padded with +inf time (never chosen). Choices are option indices.
    `switch_latency_s` is the effective clock-change latency every replay charges (module doc).
    """

    def __init__(
        self,
        schedule: PipelineSchedule,
        profile: Profile,
        blocking_power: float,
        switch_latency_s: float = 0.0,
        *,
        energy_filter_on_every_path: bool = False,
    ):
        """`energy_filter_on_every_path`: computations every path of the iteration passes through
        (`PipelineDAG.on_every_path`) keep only clocks cheaper in energy than every faster one.
        Right for a frontier of (time, energy) alone: time such a computation saves shortens the
        iteration, so no blocking is saved. Not for plans of an iteration held to a deadline
        (the wait-aware extension), where they can wait too."""
        if not np.isfinite(blocking_power) or blocking_power < 0:
            raise ProfileError(
                f"blocking power must be a non-negative number of watts, got {blocking_power!r}"
            )
        if not np.isfinite(switch_latency_s) or not 0 <= switch_latency_s <= 10.0:
            raise ProfileError(
                f"switch_latency_s must be between 0 and 10 seconds, got {switch_latency_s!r}"
            )
        self.switch_latency_s = float(switch_latency_s)
        self.dag = PipelineDAG(schedule)
        self.blocking_power = float(blocking_power)
        if profile.num_stages == schedule.num_virtual_stages:
            per_virtual_stage = True
        elif profile.num_stages == schedule.num_stages:
            # A per-GPU profile: each of a stage's chunks holds an equal share of its layers.
            per_virtual_stage = False
        else:
            raise ProfileError(
                f"{profile.source} has {profile.num_stages} stages but the schedule has "
                f"{schedule.num_stages} stages x {schedule.num_chunks} virtual stages; profile every stage "
                f"(or every virtual stage) of this pipeline"
            )
        share = [1.0 / max(1, count) for count in schedule.chunks_per_stage]
        options = []
        scales = []
        never_slack = self.dag.on_every_path if energy_filter_on_every_path else None
        for i, c in enumerate(self.dag.computations):
            if per_virtual_stage:
                stage, scale = schedule.virtual_stage(c), 1.0
            else:
                stage, scale = c.stage, share[c.stage]
            op = profile[stage, c.kind.value]
            if never_slack is not None and never_slack[i]:
                keep = np.array(pareto_indices(op.times, op.energies))
                op = OperatingPoints(op.frequencies[keep], op.times[keep], op.energies[keep])
            options.append(op)
            scales.append(scale)
        width = max(len(op) for op in options)
        n = len(options)
        self.num_options = np.array([len(op) for op in options])
        self.times = np.full((n, width), np.inf)
        self.energies = np.full((n, width), np.inf)
        self.frequencies = np.zeros((n, width), dtype=np.int64)
        for i, (op, scale) in enumerate(zip(options, scales)):
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

    def replay(
        self, choice: np.ndarray, switch_latency_s: float | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(iteration time, energy) of choices shaped (N,) or (N, plans).

        Charges the model's switch latency unless `switch_latency_s` overrides it (the solver's
        inner steps plan on the latency-free model and pass 0).
        """
        choice = np.asarray(choice)
        latency = self.switch_latency_s if switch_latency_s is None else switch_latency_s
        if latency > 0:
            trace = self.latency_trace(choice, latency)
            makespan = trace.finish.max(axis=0)
            idle = self.num_stage_gpus * makespan - trace.durations.sum(axis=0)
            return makespan, trace.node_energies.sum(axis=0) + self.blocking_power * idle
        durations = self._take(self.times, choice)
        makespan = self.dag.makespan(durations)
        compute = self._take(self.energies, choice).sum(axis=0)
        idle = self.num_stage_gpus * makespan - durations.sum(axis=0)
        return makespan, compute + self.blocking_power * idle

    @cached_property
    def carry_from_prev(self) -> np.ndarray:
        """(N, width): option of node i nearest in clock to option k of i's stage predecessor
        (row of zeros for a stage's first node: the fastest clock is in force before it)."""
        return self._clock_map(self.dag.stage_prev)

    @cached_property
    def carry_from_next(self) -> np.ndarray:
        """(N, width): option of node i nearest in clock to option k of i's stage successor."""
        return self._clock_map(self.dag.stage_next)

    def _clock_map(self, other: np.ndarray) -> np.ndarray:
        """Nodes of one stage and kind share a clock table: map table pairs, not nodes."""
        tables, table_of = np.unique(self.frequencies, axis=0, return_inverse=True)
        table_of = table_of.ravel()
        width = self.frequencies.shape[1]
        has_other = other >= 0
        pair_keys = np.where(has_other, table_of * len(tables) + table_of[other], -1)
        keys, pair_of = np.unique(pair_keys, return_inverse=True)
        maps = np.zeros((len(keys), width), dtype=np.int64)
        for row, key in enumerate(keys):
            if key < 0:
                continue
            own, src = tables[key // len(tables)], tables[key % len(tables)]
            own = np.where(own > 0, own, -(10**9))  # padding never matches
            maps[row] = np.abs(own[None, :] - src[:, None]).argmin(axis=1)
        return maps[pair_of.ravel()]

    def latency_trace(self, choice: np.ndarray, switch_latency_s: float | None = None) -> LatencyTrace:
        """Latency-aware replay of choices (N,) or (N, plans), node by node (module doc)."""
        latency = self.switch_latency_s if switch_latency_s is None else switch_latency_s
        choice = np.asarray(choice)
        dag = self.dag
        prev = dag.stage_prev
        shape = (-1,) + (1,) * (choice.ndim - 1)
        width = self.times.shape[1]
        base = (np.arange(self.num_nodes) * width).reshape(shape)
        prev_choice = np.where((prev >= 0).reshape(shape), choice[prev], 0)
        carried = np.take(self.carry_from_prev, prev_choice + base)
        own, old = choice + base, carried + base
        own_t, old_t = np.take(self.times, own), np.take(self.times, old)
        # Per second spent at the old clock: duration and energy added to the own-clock
        # figures (both 0 without a switch, so those nodes replay exactly as without latency).
        stretch = 1.0 - own_t / old_t
        extra_energy = (np.take(self.energies, old) - np.take(self.energies, own)) / old_t
        finish = np.zeros((len(dag) + 1,) + choice.shape[1:])  # row -1: iteration start
        tau = np.zeros(choice.shape)
        for lv, slots in dag.level_preds:
            start = gather_max(finish, slots)
            tau[lv] = np.clip(finish[prev[lv]] + (latency - start), 0.0, old_t[lv])
            finish[lv] = start + (own_t[lv] + tau[lv] * stretch[lv])
        durations = own_t + tau * stretch
        node_energies = np.take(self.energies, own) + tau * extra_energy
        return LatencyTrace(finish[:-1], durations, node_energies, carried)

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
        order, clocks = self._clocks_by_stage
        choices = np.asarray(choices)
        # One flat gather in stage order (per-stage gathers and a stack cost more).
        freqs = np.take(clocks, choices[order] + (np.arange(len(order)) * self.frequencies.shape[1])[:, None])
        lengths = {len(pos) for pos in self.dag.stage_positions}
        if len(lengths) == 1:
            table = np.ascontiguousarray(freqs.T).reshape(choices.shape[1], len(self.dag.stage_positions), -1)
        else:  # stages of different lengths: shorter rows end in zeros (no clock, `Plan`)
            table = np.zeros((choices.shape[1], len(self.dag.stage_positions), max(lengths)), dtype=np.int32)
            start = 0
            for stage, pos in enumerate(self.dag.stage_positions):
                table[:, stage, : len(pos)] = freqs[start : start + len(pos)].T
                start += len(pos)
        table.flags.writeable = False
        return [Plan(float(t), float(e), table[j]) for j, (t, e) in enumerate(zip(times, energies))]

    @cached_property
    def _clocks_by_stage(self) -> tuple[np.ndarray, np.ndarray]:
        """(nodes stage by stage in execution order, their clock tables flattened as int32)."""
        order = np.concatenate(self.dag.stage_positions)
        return order, self.frequencies[order].astype(np.int32).ravel()

    def choice_of(self, plan: Plan) -> np.ndarray:
        """Option indices of a plan's clocks (inverse of `to_plan`)."""
        choice = np.empty(self.num_nodes, dtype=np.int64)
        for stage, pos in enumerate(self.dag.stage_positions):
            row = plan.for_stage(stage)
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
