"""What a whole data-parallel job spends per iteration, with and without perseus-ext.

One pipeline is planned exactly as the runtime plans it (`solve_frontier` on the stage profile)
and the frontier is handed to the same `OperatingPointPolicy` the runtime calls; the job is then
DP copies of that pipeline, one of which may straggle. Energy of one iteration of the job:

- computation: every forward/backward at its clock (profiled energy, all TP x PP GPUs);
- bubble: each pipeline's GPUs blocked inside their own iteration (fill/drain, waiting on
  neighbour stages), at the blocking power;
- sync wait: GPUs of pipelines that finished their iteration early, blocked at the gradient
  sync until the slowest pipeline arrives;
- straggler stall: the straggler's own GPUs idle for the external slowdown (T' minus the
  straggler plan's time).

Strategies compared (see docs/emulator.md): all GPUs at max clock; a Zeus-style single clock for
every GPU; an EnvPipe-style plan (the bottleneck stage at max clock, every other stage at one
lower clock); perseus-ext without straggler information (intrinsic only); perseus-ext as before
wait-aware planning (non-stragglers stop at the minimum-energy plan T*); perseus-ext with a
detected straggler (non-stragglers wait-aware, the straggler at its fastest plan); and
perseus-ext (every pipeline whose iteration ends at T' plans for it, wait-aware).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Callable

import numpy as np

from perseus_ext.emulator.layout import JobLayout
from perseus_ext.emulator.scenario import StragglerScenario
from perseus_ext.errors import ConfigError, ProfileError
from perseus_ext.planning.derived import DERIVED_KINDS, DerivationRule, derive_kinds
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import Profile
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy

FrontierSolver = Callable[..., Frontier]  # as solve_frontier(schedule, profile, blocking_power, wait_aware=)

MAX_CLOCK = "max-clock"
GLOBAL_CLOCK = "global-clock"
ENVPIPE = "envpipe"
INTRINSIC = "perseus-intrinsic"
PERSEUS_T_STAR = "perseus-t-star"
PERSEUS_DETECTED = "perseus-detected"
PERSEUS = "perseus"
STRATEGIES = (MAX_CLOCK, GLOBAL_CLOCK, ENVPIPE, INTRINSIC, PERSEUS_T_STAR, PERSEUS_DETECTED, PERSEUS)
STRATEGY_LABELS = {
    MAX_CLOCK: "all GPUs at max clock",
    GLOBAL_CLOCK: "Zeus-style global clock",
    ENVPIPE: "EnvPipe-style (off-critical stages, one clock)",
    INTRINSIC: "perseus-ext intrinsic only",
    PERSEUS_T_STAR: "perseus-ext stopping at T*",
    PERSEUS_DETECTED: "perseus-ext, straggler at fastest plan",
    PERSEUS: "perseus-ext intrinsic + extrinsic",
}
_TIME_TOLERANCE = 1e-9  # relative; a plan "meets" a time it matches up to float noise


@dataclass(frozen=True)
class IterationEnergy:
    """Time and energy (joules, whole job) of one training iteration, by where it goes."""

    time: float
    computation: float
    bubble: float
    sync_wait: float
    straggler_stall: float

    @property
    def total(self) -> float:
        return self.computation + self.bubble + self.sync_wait + self.straggler_stall

    @property
    def blocking(self) -> float:
        return self.bubble + self.sync_wait + self.straggler_stall

    @staticmethod
    def mean(parts: list["IterationEnergy"], weights: tuple[float, ...]) -> "IterationEnergy":
        """Expected iteration over a scenario's mix of slowdowns."""
        w = np.asarray(weights, dtype=float) / float(np.sum(weights))

        def avg(name: str) -> float:
            return float(sum(wi * getattr(p, name) for wi, p in zip(w, parts)))

        return IterationEnergy(
            avg("time"), avg("computation"), avg("bubble"), avg("sync_wait"), avg("straggler_stall")
        )

    def to_dict(self) -> dict:
        return {
            "time_s": self.time,
            "energy_j": self.total,
            "computation_j": self.computation,
            "bubble_j": self.bubble,
            "sync_wait_j": self.sync_wait,
            "straggler_stall_j": self.straggler_stall,
        }


@dataclass(frozen=True)
class Deployment:
    """The plans a strategy runs at one slowdown factor."""

    factor: float
    straggler: Plan  # what the straggling pipeline runs (or every pipeline, with no straggler)
    others: Plan  # what every non-straggler pipeline runs


@dataclass(frozen=True)
class StrategyOutcome:
    """One strategy's expected iteration under a scenario, and its saving vs max clock."""

    strategy: str
    iteration: IterationEnergy
    saving: float
    deployments: tuple[Deployment, ...]
    note: str = ""

    @property
    def label(self) -> str:
        return STRATEGY_LABELS[self.strategy]


@dataclass(frozen=True)
class Emulation:
    """Every strategy's outcome for one job layout and straggler scenario."""

    layout: JobLayout
    scenario: StragglerScenario
    outcomes: dict[str, StrategyOutcome]
    frontier: Frontier = field(repr=False)

    @property
    def baseline(self) -> StrategyOutcome:
        return self.outcomes[MAX_CLOCK]

    @property
    def intrinsic_saving(self) -> float:
        """Saving of the fastest plan alone: no slowdown, no straggler information."""
        return self.outcomes[INTRINSIC].saving

    @property
    def extrinsic_saving(self) -> float:
        """Further saving (share of the max-clock energy) from slowing non-stragglers."""
        return self.outcomes[PERSEUS].saving - self.outcomes[INTRINSIC].saving

    @property
    def total_saving(self) -> float:
        return self.outcomes[PERSEUS].saving

    def rows(self) -> list[dict]:
        """Flat records (one per strategy) for CSV/JSON."""
        rows = []
        layout = self.layout.describe()
        for key in STRATEGIES:
            out = self.outcomes[key]
            rows.append({
                **layout,
                "scenario": self.scenario.name,
                "slowdown": self.scenario.factors[0] if self.scenario.is_steady else None,
                "strategy": key,
                **out.iteration.to_dict(),
                "saving": out.saving,
                "intrinsic_saving": self.intrinsic_saving if key == PERSEUS else None,
                "extrinsic_saving": self.extrinsic_saving if key == PERSEUS else None,
                "note": out.note,
            })
        return rows


@dataclass(frozen=True)
class _PipelineCost:
    """One pipeline running one plan: its own iteration time and energy split."""

    time: float
    computation: float
    bubble: float


class Emulator:
    """Emulates a TP x PP x DP job from a profiled pipeline slice.

    `profile` is the measured stage profile, every clock as measured (`load_profile(path)`):
    the planner keeps its useful clocks (`Profile.useful_clocks`), while the max-clock and
    global-clock baselines replay the GPUs' measured behaviour at every clock, dominated ones
    included. Scaling to the full model: each stage's times are multiplied by `time_scale`
    and each GPU's energies by `energy_scale` (default: `time_scale`, i.e. the full model has
    that many times the profiled layers per stage); each stage has TP GPUs, each measured
    like the profiled one and each drawing `blocking_power` watts while blocked. The paper's
    GPT-3 175B setup (time x10, energy x10 x TP) is `time_scale=10` with TP=8.

    A schedule that runs kinds of computation the profile lacks (the input- and weight-gradient
    computations of a zero-bubble schedule, the combined units of combined_1f1b) gets them
    estimated from the forward/backward rows by `derivation` (`planning.derived`; default
    `DerivationRule()`); `derived_kinds` lists them.
    """

    def __init__(
        self,
        profile: Profile,
        layout: JobLayout,
        blocking_power: float,
        *,
        time_scale: float = 1.0,
        energy_scale: float | None = None,
        policy: OperatingPointPolicy | None = None,
        solver: FrontierSolver | None = None,
        wait_aware: bool = True,
        derivation: DerivationRule | None = None,
    ):
        energy_scale = time_scale if energy_scale is None else energy_scale
        for name, value in (("time_scale", time_scale), ("energy_scale", energy_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(blocking_power) and blocking_power >= 0):
            raise ConfigError(f"blocking power must be >= 0 watts, got {blocking_power!r}")
        self.layout = layout
        self.schedule = layout.build_schedule()
        needed = {unit.kind.value for order in self.schedule.orders for action in order
                  for unit in (action, *action.parts)}
        present = {instruction for _, instruction in profile.points}
        self.derived_kinds = tuple(k for k in DERIVED_KINDS if k in needed and k not in present)
        if self.derived_kinds:
            profile = derive_kinds(profile, derivation, self.derived_kinds)
        self.profile = profile
        self.blocking_power = float(blocking_power)
        self.time_scale = float(time_scale)
        self.energy_scale = float(energy_scale)
        self.policy = policy or StragglerPolicy()
        if solver is None:
            from perseus_ext.planning.options import SolverOptions
            from perseus_ext.planning.solver import solve_frontier

            # The frontier is solved on the profiled slice, whose times are the stage's divided
            # by time_scale: the clock-change budget is put in the slice's seconds too.
            solver = partial(solve_frontier, options=SolverOptions().for_time_scale(self.time_scale))
        self._solver = solver
        self.wait_aware = wait_aware
        tp = layout.tensor_parallel
        # One "stage" of the cost model is the stage's TP GPUs together.
        self.stage_blocking_power = self.blocking_power * tp
        self.model = CostModel(
            self.schedule,
            profile.scaled(self.time_scale, self.energy_scale * tp),
            self.stage_blocking_power,
        )
        self._costs: dict[Plan, _PipelineCost] = {}

    # ----------------------------------------------------------------- plans
    @cached_property
    def frontier(self) -> Frontier:
        """The runtime's frontier for one full-size pipeline.

        Solved on the profiled slice with the blocking power rescaled so the slice's energy
        model is the full model's divided by (energy_scale x TP) and its times by time_scale;
        plans are then scaled back. This is exact (the frequency choices are the same) and
        keeps the solver's time grid at the slice's resolution, which is what makes the
        emulator fast. With `wait_aware` (the runtime's default) the frontier carries the
        wait-aware plans past its minimum-energy plan, from the same solve.
        """
        slice_blocking = self.blocking_power * self.time_scale / self.energy_scale
        solved = self._solver(self.schedule, self.profile, slice_blocking, wait_aware=self.wait_aware)
        energy_factor = self.energy_scale * self.layout.tensor_parallel

        def scale(plan: Plan) -> Plan:
            return replace(plan, time=plan.time * self.time_scale, energy=plan.energy * energy_factor)

        return Frontier(
            schedule=solved.schedule,
            blocking_power=self.stage_blocking_power,
            plans=tuple(scale(p) for p in solved.plans),
            baseline=scale(solved.baseline),
            extension_start=solved.extension_start,
        )

    @cached_property
    def uniform_plans(self) -> dict[int, Plan]:
        """Every computation at one clock, for each clock every computation was profiled at;
        fastest clock first."""
        model = self.model
        counts = model.num_options
        common = set(model.frequencies[0, : counts[0]].tolist())
        for node in range(1, model.num_nodes):
            common &= set(model.frequencies[node, : counts[node]].tolist())
        if not common:
            raise ProfileError(
                f"{self.profile.source}: no SM clock was profiled for every stage and "
                f"instruction; the max-clock and global-clock baselines need at least one"
            )
        clocks = sorted(common, reverse=True)
        choices = np.stack(
            [np.argmax(model.frequencies == clock, axis=1) for clock in clocks], axis=1
        )
        times, energies = model.replay(choices)
        return dict(zip(clocks, model.make_plans(choices, times, energies)))

    @cached_property
    def envpipe_plans(self) -> dict[int, Plan]:
        """EnvPipe-style plans: the bottleneck stage (most busy time at max clock) keeps the max
        clock, every other stage runs one lower clock; per clock of `uniform_plans`."""
        model = self.model
        per_clock = [np.argmax(model.frequencies == clock, axis=1) for clock in self.uniform_plans]
        busy = np.bincount(model.dag.stage, weights=model.times[np.arange(model.num_nodes), per_clock[0]])
        on_critical = model.dag.stage == int(np.argmax(busy))
        choices = np.stack([np.where(on_critical, per_clock[0], c) for c in per_clock], axis=1)
        return dict(zip(self.uniform_plans, self.plans_from_choices(choices)))

    @property
    def max_clock_plan(self) -> Plan:
        """All GPUs at their highest profiled clock: training without perseus-ext."""
        return next(iter(self.uniform_plans.values()))

    @property
    def reference_time(self) -> float:
        """T in T'/T: the fastest iteration time of one pipeline."""
        return self.frontier.fastest.time

    def straggler_time(self, factor: float) -> float | None:
        """The straggler's iteration time T' at a slowdown factor (None: no straggler)."""
        return None if factor <= 1.0 else factor * self.reference_time

    # ------------------------------------------------------------ accounting
    def plans_from_choices(self, choices: np.ndarray) -> list[Plan]:
        """Plans of a batch of option choices shaped (nodes, plans), replayed at once and
        remembered for `iteration` (which would otherwise replay each plan again)."""
        model = self.model
        times, energies = model.replay(choices)
        computation = np.take_along_axis(model.energies, choices, axis=1).sum(axis=0)
        plans = model.make_plans(choices, times, energies)
        for plan, time, energy, compute in zip(plans, times, energies, computation):
            self._costs[plan] = _PipelineCost(float(time), float(compute), float(energy - compute))
        return plans

    def _cost(self, plan: Plan) -> _PipelineCost:
        cost = self._costs.get(plan)
        if cost is None:
            model = self.model
            choice = model.choice_of(plan)
            time, energy = model.replay(choice)
            computation = float(model.energies[np.arange(model.num_nodes), choice].sum())
            cost = _PipelineCost(float(time), computation, float(energy) - computation)
            self._costs[plan] = cost
        return cost

    def iteration(self, deployment: Deployment) -> IterationEnergy:
        """Energy of one job iteration: one straggler pipeline (if the factor is > 1) running
        `deployment.straggler`, every other pipeline running `deployment.others`."""
        dp = self.layout.data_parallel
        # Blocking energy per second of one whole pipeline (all its TP x PP GPUs).
        pipeline_blocking_power = self.stage_blocking_power * self.model.num_stage_gpus
        straggler_time = self.straggler_time(deployment.factor)
        if straggler_time is None:
            cost = self._cost(deployment.others)
            return IterationEnergy(cost.time, dp * cost.computation, dp * cost.bubble, 0.0, 0.0)
        strag = self._cost(deployment.straggler)
        others = self._cost(deployment.others)
        strag_time = max(straggler_time, strag.time)
        job_time = max(strag_time, others.time) if dp > 1 else strag_time
        n_others = dp - 1
        return IterationEnergy(
            time=job_time,
            computation=strag.computation + n_others * others.computation,
            bubble=strag.bubble + n_others * others.bubble,
            sync_wait=pipeline_blocking_power * (
                n_others * (job_time - others.time) + (job_time - strag_time)
            ),
            straggler_stall=pipeline_blocking_power * (strag_time - strag.time),
        )

    # ------------------------------------------------------------ strategies
    def _policy_deployment(self, factor: float, informed: bool, straggler_plans: bool = False) -> Deployment:
        """What the runtime deploys. Uninformed: every pipeline runs the no-straggler plan.
        Informed: every non-straggler gets the policy's plan for the straggler's time T'; the
        straggler keeps the no-straggler plan unless `straggler_plans`, i.e. its own iteration
        also ends at T' whatever its plan (the emulator's stall model: its extra time is its GPUs
        idling, outside its computations; the runtime learns T' from an announced slowdown)."""
        frontier = self.frontier
        own = self.policy.select(frontier, None)
        straggler_time = self.straggler_time(factor)
        if informed and straggler_time is not None:
            held = self.policy.select(frontier, straggler_time)
            return Deployment(factor, held if straggler_plans else own, held)
        return Deployment(factor, own, own)

    def _t_star_deployment(self, factor: float) -> Deployment:
        """Perseus before wait-aware planning: non-stragglers take the least-energy plan within
        T' on the ordinary frontier, never past its minimum-energy plan T*."""
        frontier = self.frontier
        straggler_time = self.straggler_time(factor)
        others = frontier.fastest if straggler_time is None else frontier.plan_for_deadline(straggler_time)
        return Deployment(factor, frontier.fastest, others)

    def _expected(self, deployments: list[Deployment], scenario: StragglerScenario) -> IterationEnergy:
        return IterationEnergy.mean([self.iteration(d) for d in deployments], scenario.weights)

    def run(self, scenario: StragglerScenario) -> Emulation:
        """Every strategy under `scenario`; the policy reacts to each slowdown (it knows T')."""
        factors = scenario.factors
        outcomes: dict[str, StrategyOutcome] = {}

        base_plan = self.max_clock_plan
        base_deps = tuple(Deployment(f, base_plan, base_plan) for f in factors)
        base = self._expected(list(base_deps), scenario)

        def outcome(key: str, deps: tuple[Deployment, ...], note: str = "") -> StrategyOutcome:
            it = self._expected(list(deps), scenario)
            return StrategyOutcome(key, it, 1.0 - it.total / base.total, deps, note)

        outcomes[MAX_CLOCK] = outcome(MAX_CLOCK, base_deps, f"{_clock_of(base_plan)} MHz")

        # Zeus-style: ONE clock for every GPU for the whole run, the least-energy one whose
        # expected iteration time is no longer than all-max-clock's; EnvPipe-style likewise.
        for key, plans in ((GLOBAL_CLOCK, self.uniform_plans), (ENVPIPE, self.envpipe_plans)):
            best: tuple[float, int, tuple[Deployment, ...]] | None = None
            for clock, plan in plans.items():
                deps = tuple(Deployment(f, plan, plan) for f in factors)
                it = self._expected(list(deps), scenario)
                if it.time <= base.time * (1 + _TIME_TOLERANCE) and (best is None or it.total < best[0]):
                    best = (it.total, clock, deps)
            assert best is not None  # the max clock itself always qualifies
            outcomes[key] = outcome(key, best[2], f"{best[1]} MHz")

        note = f"policy {self.policy.name}"
        intrinsic = tuple(self._policy_deployment(f, informed=False) for f in factors)
        outcomes[INTRINSIC] = outcome(INTRINSIC, intrinsic, note)
        outcomes[PERSEUS_T_STAR] = outcome(
            PERSEUS_T_STAR, tuple(self._t_star_deployment(f) for f in factors), "lowest energy within T'")
        detected = tuple(self._policy_deployment(f, informed=True) for f in factors)
        outcomes[PERSEUS_DETECTED] = outcome(PERSEUS_DETECTED, detected, note)
        held = tuple(self._policy_deployment(f, informed=True, straggler_plans=True) for f in factors)
        outcomes[PERSEUS] = outcome(PERSEUS, held, note)
        return Emulation(self.layout, scenario, outcomes, self.frontier)

    def sweep(self, factors: list[float]) -> list[Emulation]:
        """One steady-straggler emulation per slowdown factor (the frontier is solved once)."""
        return [self.run(StragglerScenario.fixed(f)) for f in factors]


def _clock_of(plan: Plan) -> int:
    return int(plan.frequencies[0][0])
