"""Stage-constant plans: one clock per stage for the whole iteration (graph-safe plans).

A full-iteration CUDA graph replays every computation of an iteration without a single Python
hook, so the only clock changes that can still follow the plan are the ones made between two
replays: each stage runs its whole iteration at one clock. This module solves the frontier of
such plans on the same cost model as `solver.py` -- the same `CostModel` replay (latency-aware; a stage-constant plan has
no change inside an iteration, so none is charged), blocking power for every idle stage -- and
returns an ordinary `Frontier`, so the straggler policy (`Frontier.plan_for_deadline`) and the
wait-aware extension (plans Pareto-optimal in energy - blocking power x stages x time past the
minimum-energy plan, `Frontier.extension_start`) work on it unchanged. Every plan's clocks are
constant along each row of `Plan.frequencies`.

Method. A stage may only run clocks measured for every one of its computations (forward and
backward of every model chunk on that GPU); every such clock is a candidate, since whether a
clock is worth running is a property of the whole stage, not of one computation's table
(`Profile.useful_clocks` judges per computation, which is right for per-computation plans). The plan space is small (K clocks per stage, S
stages) but K^S is not, so the search is a greedy descent plus local search, batched like the
per-computation solver's passes:

1. *Seeds.* A greedy chain and every global clock.
   *Greedy chain.* From every stage at its fastest clock, repeatedly slow one stage by one clock:
   a move that costs no time and saves energy first, else the move with the least energy per
   second of iteration time (which may be an increase), until every stage is at its slowest
   clock. This spans T_min to the all-slowest plan.
   *Global clocks.* Every stage at the same clock, for each clock they all have.
2. *Local search.* Every plan on the current (time, energy) and (time, energy - P S time)
   Pareto sets moves any one stage to any of its clocks, any two stages one clock each (either
   direction), and every stage one clock together;
   every neighbour is replayed and kept if it improves either set; repeated until no round
   adds a Pareto plan.

`tests/test_stage_constant.py` compares the result with every stage-constant plan enumerated on
small pipelines.
"""

from __future__ import annotations

import logging

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.clock_budget import with_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.passes import REPLAY_CELLS
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.wait_aware import distinct_plans, pareto_plans

logger = logging.getLogger(__name__)

_SEARCH_ROUNDS = 10  # at most; the search stops when a round adds no Pareto plan
_SEARCH_PLANS = 32  # Pareto plans per set whose neighbours one round replays


class StageConstantModel:
    """The per-computation `CostModel` seen through one clock index per stage."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        stage_of_node = model.dag.stage
        self.num_stages = model.schedule.num_stages
        self.stage_of_node = stage_of_node
        self.clocks: list[np.ndarray] = []  # per stage, fastest first
        width = 0
        rows = []
        for stage in range(self.num_stages):
            nodes = np.flatnonzero(stage_of_node == stage)
            common = None
            for i in nodes:
                measured = set(model.frequencies[i, : model.num_options[i]].tolist())
                common = measured if common is None else common & measured
            if not common:
                raise SolverError(
                    f"stage {stage} has no clock measured for every one of its computations: "
                    f"a stage-constant plan needs one; profile the same clocks for its forward and backward")
            clocks = np.array(sorted(common, reverse=True), dtype=np.int64)
            self.clocks.append(clocks)
            rows.append((nodes, clocks))
            width = max(width, len(clocks))
        # option[i, k]: node i's option index for its stage's k-th clock (padded with the slowest)
        self.option = np.zeros((model.num_nodes, width), dtype=np.int64)
        for nodes, clocks in rows:
            for i in nodes:
                row = model.frequencies[i, : model.num_options[i]]
                index = {int(f): j for j, f in enumerate(row)}
                options = [index[int(f)] for f in clocks]
                self.option[i] = options + [options[-1]] * (width - len(options))
        self.num_clocks = np.array([len(c) for c in self.clocks])

    def choices(self, levels: np.ndarray) -> np.ndarray:
        """Per-computation choices (N, plans) of stage clock indices `levels` (S, plans)."""
        return self.option[np.arange(self.model.num_nodes)[:, None], levels[self.stage_of_node]]

    def replay(self, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(times, energies) of stage clock indices `levels` (S, plans), in batches."""
        step = max(1, REPLAY_CELLS // self.model.num_nodes)
        times, energies = [], []
        for k in range(0, levels.shape[1], step):
            t, e = self.model.replay(self.choices(levels[:, k : k + step]))
            times.append(np.atleast_1d(t))
            energies.append(np.atleast_1d(e))
        return np.concatenate(times), np.concatenate(energies)


class _Pool:
    """Distinct stage-constant plans (as clock-index columns) with their replays."""

    def __init__(self, space: StageConstantModel, floor_s: float) -> None:
        self.space = space
        self.floor_s = floor_s  # plans faster than this (the all-max-clock time) are left out
        self.levels = np.zeros((space.num_stages, 0), dtype=np.int64)
        self.times = np.zeros(0)
        self.energies = np.zeros(0)
        self._seen: set[bytes] = set()

    def add(self, levels: np.ndarray) -> int:
        """Replay and keep the new columns of `levels`; how many were new."""
        fresh = []
        for k in range(levels.shape[1]):
            key = levels[:, k].tobytes()
            if key not in self._seen:
                self._seen.add(key)
                fresh.append(k)
        if not fresh:
            return 0
        levels = levels[:, fresh]
        times, energies = self.space.replay(levels)
        self.levels = np.concatenate([self.levels, levels], axis=1)
        self.times = np.concatenate([self.times, times])
        self.energies = np.concatenate([self.energies, energies])
        return len(fresh)

    def pareto(self, slope: float) -> np.ndarray:
        """Columns Pareto-optimal in (time, energy - slope x time), by time."""
        order = np.lexsort((self.energies - slope * self.times, np.round(self.times, 12)))
        kept, best = [], np.inf
        for k in order[self.times[order] >= self.floor_s]:
            cost = self.energies[k] - slope * self.times[k]
            if cost < best - 1e-9:
                kept.append(k)
                best = cost
        return np.array(kept, dtype=np.int64)


def _greedy_chain(space: StageConstantModel) -> np.ndarray:
    """Step 1 of the module docstring: the chain of plans, as clock-index columns."""
    level = np.zeros(space.num_stages, dtype=np.int64)
    time, energy = (float(v[0]) for v in space.replay(level[:, None]))
    chain = [level.copy()]
    while True:
        movable = np.flatnonzero(level < space.num_clocks - 1)
        if not movable.size:
            break
        candidates = np.repeat(level[:, None], len(movable), axis=1)
        candidates[movable, np.arange(len(movable))] += 1
        times, energies = space.replay(candidates)
        d_time, d_energy = times - time, energies - energy
        free = np.flatnonzero((d_time <= 1e-12) & (d_energy < 0))
        if free.size:
            pick = free[np.argmin(d_energy[free])]
        else:
            pick = int(np.argmin(d_energy / np.maximum(d_time, 1e-12)))
        level = candidates[:, pick].copy()
        time, energy = float(times[pick]), float(energies[pick])
        chain.append(level.copy())
    return np.stack(chain, axis=1)


def _uniform_seeds(space: StageConstantModel) -> np.ndarray:
    """Every stage at the same clock, for each clock all stages have (Zeus-style global clocks:
    the stage-constant frontier must never be worse than one of them)."""
    shared = set(space.clocks[0].tolist()).intersection(*(c.tolist() for c in space.clocks[1:]))
    columns = [[int(np.flatnonzero(clocks == f)[0]) for clocks in space.clocks] for f in sorted(shared, reverse=True)]
    return np.array(columns, dtype=np.int64).T if columns else np.zeros((space.num_stages, 0), dtype=np.int64)


def _neighbours(space: StageConstantModel, levels: np.ndarray) -> np.ndarray:
    """Every plan one stage away (any clock), two stages one clock away each (either direction),
    and every stage one clock slower or faster, of each column."""
    out = []
    stages = space.num_stages
    top = space.num_clocks - 1
    for column in levels.T:
        for step in (1, -1):
            out.append(np.clip(column + step, 0, top))
        for s in range(stages):
            for k in range(space.num_clocks[s]):
                if k != column[s]:
                    moved = column.copy()
                    moved[s] = k
                    out.append(moved)
        for a in range(stages):
            for b in range(a + 1, stages):
                for da, db in ((1, -1), (-1, 1), (1, 1), (-1, -1)):
                    moved = column.copy()
                    moved[a] += da
                    moved[b] += db
                    if 0 <= moved[a] < space.num_clocks[a] and 0 <= moved[b] < space.num_clocks[b]:
                        out.append(moved)
    return np.stack(out, axis=1) if out else np.zeros((stages, 0), dtype=np.int64)


def _sample(indices: np.ndarray, count: int) -> np.ndarray:
    if len(indices) <= count:
        return indices
    return indices[np.linspace(0, len(indices) - 1, count).astype(int)]


def solve_stage_constant(
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    switch_latency_s: float = 0.0,
    *,
    wait_aware: bool = False,
) -> Frontier:
    """The frontier of stage-constant plans (module docstring); `wait_aware` appends the plans
    for iterations held to a longer deadline, as `solve_frontier(..., wait_aware=True)` does."""
    # Every measured clock: usefulness is a property of the whole stage here. A clock that one
    # computation's table drops (another clock of that computation is no slower and no costlier
    # in e - P t) can still be the stage's best one clock, and dropping it per computation left
    # stages with a handful of common clocks (GPT-3 on A40: one global clock beat the frontier).
    model = CostModel(schedule, profile, blocking_power, switch_latency_s)
    space = StageConstantModel(model)
    slope = schedule.num_stages * blocking_power
    slopes = (0.0, slope) if wait_aware else (0.0,)
    baseline = model.to_plan(model.fastest_choice())
    # Noise can make a mix of clocks faster than every stage at its max clock, at more energy:
    # the frontier starts at the all-max-clock time, as the per-computation one does (its
    # fastest plan is the intrinsic-bloat plan).
    pool = _Pool(space, baseline.time * (1 - 1e-12))
    pool.add(_greedy_chain(space))
    pool.add(_uniform_seeds(space))
    for _ in range(_SEARCH_ROUNDS):
        front = np.unique(np.concatenate([_sample(pool.pareto(s), _SEARCH_PLANS) for s in slopes]))
        before = {tuple(pool.pareto(s)) for s in slopes}
        pool.add(_neighbours(space, pool.levels[:, front]))
        if {tuple(pool.pareto(s)) for s in slopes} == before:
            break
    keep = np.unique(np.concatenate([pool.pareto(s) for s in slopes]))
    choices = space.choices(pool.levels[:, keep])
    plans = with_figures(model, choices, model.make_plans(choices, pool.times[keep], pool.energies[keep]))
    candidates = distinct_plans(plans)
    ordinary = pareto_plans(candidates, 0.0)
    extension: list[Plan] = []
    if wait_aware:
        chosen = {id(p) for p in ordinary}
        extension = [p for p in pareto_plans(candidates, slope) if id(p) not in chosen]  # by time
    frontier = Frontier(schedule.summary(), blocking_power, tuple(ordinary) + tuple(extension),
                        baseline,
                        extension_start=len(ordinary) if extension else None)
    logger.info("stage-constant frontier: %d plans (+%d wait-aware), T %.4f..%.4f s, %d plans replayed",
                len(ordinary), len(extension), ordinary[0].time, frontier.plans[-1].time, len(pool.times))
    return frontier


def is_stage_constant(plan: Plan) -> bool:
    """Whether every stage runs one clock for its whole iteration."""
    freqs = plan.frequencies
    return bool(((freqs == freqs[:, :1]) | (freqs == 0)).all())
