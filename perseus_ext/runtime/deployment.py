"""A pipeline's frontier in force on one rank: which plan runs, straggler checks, policy choice.

Every `straggler_check_interval` deployed iterations all ranks exchange their pipeline's
normalised compute time (one small all-gather) -- what the iteration would have taken at the
fastest plan: plans lengthen the compute by their model time difference, while communication
and optimizer overheads stay put, so a pipeline that slowed down on purpose never looks like a
straggler. Each pipeline then deploys the plan its leader's policy picks for "the iteration may
take as long as the slowest pipeline", broadcast to the pipeline's stages so they never disagree.
Measurements come from device-side records, which arrive an iteration or so after launch; a
check simply uses the records that have arrived.
"""

from __future__ import annotations

import datetime
import logging
import math
import statistics

from perseus_ext.errors import PerseusError
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.runtime.config import PerseusConfig
from perseus_ext.runtime.records import IterationRecord, PlanChoice, PlanSwitch
from perseus_ext.runtime.straggler import SlowdownTracker

logger = logging.getLogger(__name__)


class PlanDeployment:
    """Plan selection for one rank once its pipeline's frontier is known."""

    def __init__(self, frontier: Frontier, policy: OperatingPointPolicy, config: PerseusConfig,
                 comm: ControlPlane) -> None:
        self.frontier = frontier
        self.policy = policy
        self.config = config
        self.comm = comm
        self.tracker = SlowdownTracker(config.straggler_threshold, config.straggler_hysteresis,
                                       config.straggler_confirmations)
        self.index = 0
        self.switches: list[PlanSwitch] = []
        self._index_of = {id(plan): index for index, plan in enumerate(frontier.plans)}
        self._deployed_iterations = 0
        self._check_times: list[float] = []
        self._deadline: float | None = None
        self._policy_check_at: int | None = None
        self._recent_times: list[float] = []
        self._clock_cache: dict[tuple[int, int], tuple[int, ...]] = {}

    @property
    def plan(self) -> Plan:
        return self.frontier.plans[self.index]

    def stage_clocks(self, stage: int) -> tuple[int, ...]:
        """The deployed plan's clocks of `stage`, in its execution order (cached per plan)."""
        key = (self.index, stage)
        clocks = self._clock_cache.get(key)
        if clocks is None:
            clocks = self._clock_cache[key] = tuple(int(c) for c in self.plan.frequencies[stage])
        return clocks

    @property
    def factor(self) -> float:
        return self.tracker.factor

    def deploy(self, iteration: int) -> None:
        """First deployment (every rank of the job, same iteration); announced slowdowns count
        from the first straggler check on."""
        self._agree(iteration, None, factor=1.0, reason="deploy")

    def on_iteration(self, iteration: int, records: list[IterationRecord], announced: tuple[str, float] | None) -> None:
        """End of a deployed iteration on every rank: feed records, check when due."""
        fastest = self.frontier.fastest.time
        for record in records:
            self._recent_times.append(record.time_s)
            if record.setting.plan is not None and not record.setting.fell_back:
                planned = self.frontier.plans[record.setting.plan].time
                self._check_times.append(record.compute_s - (planned - fastest))
        del self._recent_times[:-10]
        self._deployed_iterations += 1
        if self._deployed_iterations % self.config.straggler_check_interval == 0:
            self._straggler_check(iteration, announced)
        elif self._policy_check_at is not None and self._deployed_iterations >= self._policy_check_at:
            self._agree(iteration, self._deadline, factor=self.tracker.factor,
                        reason=f"{self.policy.name} re-evaluated (period {self.policy.period_s:g} s)")

    def _straggler_check(self, iteration: int, announced: tuple[str, float] | None) -> None:
        own = statistics.median(self._check_times) if self._check_times else math.nan
        self._check_times = []
        kind, value = announced or ("", 0.0)
        rows = self.comm.all_gather_floats([
            self.comm.pipeline, own,
            value if kind == "factor" else 0.0, value if kind == "time" else 0.0,
        ])
        pipeline_time: dict[int, float] = {}
        for pipeline, seconds, _, _ in rows:
            if not math.isnan(seconds):
                pipeline_time[int(pipeline)] = max(pipeline_time.get(int(pipeline), 0.0), seconds)
        mine = pipeline_time.get(self.comm.pipeline)
        if mine is None:  # no device record yet on this pipeline: keep the plan
            return
        normal = min(pipeline_time.values())
        straggler = max(
            max(pipeline_time.values()),
            max(r[2] for r in rows) * normal,  # announced factor of the normal iteration time
            max(r[3] for r in rows),  # announced iteration time
        )
        # This pipeline may take (straggler - mine) longer without slowing the job down.
        ratio = 1.0 + (straggler - mine) / self.frontier.fastest.time
        self.tracker.update(ratio)
        factor = self.tracker.factor
        # The held factor may be up to `hysteresis` above the latest ratio; planning that much
        # below it keeps this pipeline from ever becoming the slowest one.
        margin = self.config.straggler_hysteresis
        self._deadline = None if factor <= 1.0 else self.frontier.fastest.time * (factor - margin)
        self._agree(iteration, self._deadline, factor=factor,
                    reason=f"slowest pipeline {straggler:.4f} s, this one {mine:.4f} s")

    def _agree(self, iteration: int, deadline: float | None, *, factor: float, reason: str) -> None:
        """Deploy the pipeline leader's choice on every rank of the pipeline.

        Every rank evaluates the policy (which keeps its own carbon reading current for its
        emissions ledger), but ranks may read a time-varying signal at slightly different
        moments, so only the leader's plan counts. The leader also says when to evaluate again:
        every `period_s` seconds, converted to iterations with its recent iteration time."""
        try:
            chosen = self._index_of[id(self.policy.select(self.frontier, deadline))]
        except Exception as err:  # a failing policy must not skip the broadcast below
            logger.error("perseus-ext: the %s policy failed (%r); deploying the fastest plan",
                         getattr(self.policy, "name", "?"), err)
            chosen = 0
        proposal = PlanChoice(chosen, self._policy_interval()) if self.comm.is_pipeline_leader else None
        choice: PlanChoice = self.comm.broadcast_pipeline(proposal)
        interval = choice.reevaluate_in_iterations
        self._policy_check_at = None if interval is None else self._deployed_iterations + interval
        self._switch(iteration, choice.index, factor=factor, reason=reason)

    def _policy_interval(self) -> int | None:
        period = self.policy.period_s
        if period is None:
            return None
        recent = self._recent_times
        return max(1, int(period / max(statistics.median(recent), 1e-6))) if recent else 1

    def _switch(self, iteration: int, index: int, *, factor: float, reason: str) -> None:
        if index == self.index and self.switches:
            logger.debug("perseus-ext: pipeline %d: slowdown target x%.3f keeps plan %d (%s)",
                         self.comm.pipeline, factor, index, reason)
            return
        self.index = index
        plan = self.plan
        self.switches.append(PlanSwitch(iteration, index, factor, reason, plan.time, plan.energy))
        if self.comm.is_pipeline_leader:
            logger.info("perseus-ext: pipeline %d iteration %d: plan %d/%d (%s): model time "
                        "%.4f s, energy %.1f J (fastest %.4f s, all-max-clock %.1f J)",
                        self.comm.pipeline, iteration, index, len(self.frontier.plans), reason,
                        plan.time, plan.energy, self.frontier.fastest.time, self.frontier.baseline.energy)


def parse_announcement(factor_or_time: float | datetime.timedelta | None) -> tuple[str, float] | None:
    """A cluster manager's straggler announcement: a factor of the normal iteration time, an
    absolute iteration time, or None to withdraw it."""
    if factor_or_time is None:
        return None
    if isinstance(factor_or_time, datetime.timedelta):
        seconds = factor_or_time.total_seconds()
        if seconds <= 0:
            raise PerseusError(f"announced iteration time must be positive, got {factor_or_time}")
        return ("time", seconds)
    factor = float(factor_or_time)
    if not math.isfinite(factor) or factor < 1.0:
        raise PerseusError(f"announced slowdown factor must be >= 1.0, got {factor_or_time!r}")
    return ("factor", factor)
