"""A pipeline's frontier in force on one rank: which plan runs, straggler checks, policy choice.

Every `straggler_check_interval` deployed iterations all ranks exchange their pipeline's
normalised compute time (two small all-reduces) -- what the iteration would have taken at the
fastest plan: plans lengthen the compute by their model time difference, while communication
and optimizer overheads stay put, so a pipeline that slowed down on purpose never looks like a
straggler. Each pipeline then deploys the plan its leader's policy picks for "the iteration may
take as long as the slowest pipeline", broadcast to the pipeline's stages so they never disagree.
A check's three collectives are started at three consecutive iteration boundaries and each
collected at the next one, so the training thread never waits on a round trip: a check starts
`CHECK_BOUNDARIES` deployed iterations before its boundary (every `straggler_check_interval`
deployed iterations, as the baseline probes expect) and its plan switches there, on every rank.
Measurements come from device-side records, which arrive an iteration or so after launch; a
check simply uses the records that have arrived. A frontier with a wait-aware extension keeps one
plan numbering; the policy sees the extension only when there is a deadline (the iteration then
ends at the deadline anyway), the ordinary frontier otherwise.

Returning is not left to the checks alone: a pipeline slowed for a measured straggler holds the
whole job up from the moment the straggler recovers. Each stretch of plans slowed for a measured
straggler is a straggler episode; its iterations carry the fastest plan's clocks as a recovery
program (`ClockSequencer`) and are judged off the training thread as the device ends them
(`recovery.RecoveryJudge`: their wait at the gradient sync, `straggler.RecoveryWatch`), or told by
the straggler itself during its first recovered iteration (`recovery_signal.py`). Either overrides
the episode on the device at once, so every computation the device has not started runs fast; the
training thread never waits for a device record. At the first iteration boundary after the
iteration that told (`RETURN_BOUNDARIES`, or later where the verdict comes later), the pipeline
deploys the plan it ran with no straggler. Every rank judges every iteration by the same rule on
the check's shared figures and its own wait, and the straggler's post names one iteration for all,
so on a deterministic device all ranks of a pipeline return at the same boundary; where host
noise makes one stage see it an iteration before another, that stage's override makes the other
the slowest, which it sees at the next iteration (the next check re-agrees the plan in any case),
and nothing waits on anything meanwhile. The checks keep their hysteresis: slowing down again
takes `straggler_confirmations` checks, checks whose measurements predate the return never count
towards them, and iterations the override ran fast are left out of the checks' measurements.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import statistics
from dataclasses import dataclass

from perseus_ext.errors import PerseusError
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.runtime.comm import ControlPlane, ExchangeResult, Pending, StragglerExchange
from perseus_ext.config import PerseusConfig
from perseus_ext.runtime.baseline import BaselineProbes
from perseus_ext.observability.phase import Phase
from perseus_ext.observability.iteration import IterationRecord, IterationSetting
from perseus_ext.actuation.sequencer import RecoveryProgram
from perseus_ext.runtime.records import PlanChoice, PlanSwitch, StageSolve
from perseus_ext.runtime.recovery import HeldIteration, RecoveryJudge, Verdict
from perseus_ext.runtime.recovery_signal import RecoverySignal
from perseus_ext.runtime.straggler import FreeWaits, HeldStraggler, SlowdownTracker

logger = logging.getLogger(__name__)

CHECK_BOUNDARIES = 3  # iteration boundaries from a straggler check's start to its plan switch
NOISE_MARGINS = 2.0  # a slowed plan ends at least this many wait spreads before the straggler
RECORD_KEEP = 8  # this rank's latest device records kept (the latest unslowed one: `_straggler_gone`)
RETURN_BOUNDARIES = 1  # from the iteration that told of a recovery to the boundary where the plan returns
MODEL_DISAGREEMENT = 0.10  # warn when pipeline 0's computations take this much longer or shorter than modelled
MODEL_SAMPLES = 8  # unslowed iterations whose median span the model check reads


class PlanDeployment:
    """Plan selection for one rank once its pipeline's frontier is known."""

    def __init__(self, solved: StageSolve, policy: OperatingPointPolicy, config: PerseusConfig,
                 comm: ControlPlane, schedule: PipelineSchedule, judge: RecoveryJudge | None = None,
                 signal: RecoverySignal | None = None) -> None:
        """solved: this rank's view of its pipeline's solve, with a frontier: what the policy
        chooses from (the leader's whole one, the others' without clocks), this stage's plan
        table (the clocks it runs, alike on every rank) and the profile measured for it;
        judge: where held iterations are judged as the device ends them (one of its own when
        None: fed by hand); signal: the straggler's post through the rendezvous store (None:
        none)."""
        if solved.frontier is None or solved.table is None:
            raise ValueError(f"stage {solved.stage} has no frontier to deploy ({solved.error})")
        self.frontier = frontier = solved.frontier
        self.table = solved.table
        self.schedule = schedule
        self.measured = solved.measured
        self.policy = policy
        self.config = config
        self.comm = comm
        self.tracker = SlowdownTracker(config.straggler_threshold, config.straggler_hysteresis,
                                       config.straggler_confirmations)
        self.index = 0
        self.switches: list[PlanSwitch] = []
        self._index_of = {id(plan): index for index, plan in enumerate(frontier.plans)}
        self._ordinary = dataclasses.replace(frontier, plans=frontier.ordinary_plans, extension_start=None)
        self._deployed_iterations = 0
        self._check_times: list[float] = []
        self._deadline: float | None = None
        self._policy_check_at: int | None = None
        self._plan_factor = 1.0
        self._checks: list[_CheckInFlight] = []  # straggler checks in flight, oldest first
        self._recent_times: list[float] = []
        self._clock_cache: dict[tuple[int, int], tuple] = {}
        self._model_warned = False
        self._model_ratios: list[float] = []  # measured / modelled computation span, unslowed iterations
        self.free_waits = FreeWaits()
        self.judge = judge if judge is not None else RecoveryJudge()
        self.signal = signal
        self.episode: int | None = None  # the straggler episode in force (None: no plan slowed for one)
        self._held: HeldStraggler | None = None
        self._episode_free_wait_s = 0.0
        self._verdict: Verdict | None = None  # taken, waiting for its return boundary
        self._overridden = range(0)  # iterations the device ran (partly) at the recovery program
        self._checks_decided = 0  # straggler checks decided so far, the same count on every rank
        self._records: dict[int, IterationRecord] = {}  # this rank's latest, by iteration
        self._returns = 0  # recoveries found between checks (RecoveryJudge), for stale checks
        # Waits at the unslowed plan, kept until a check covering their iterations finds no
        # straggler (then they teach `free_waits` what waiting for nobody looks like) or finds one.
        self._unvetted_free: list[tuple[int, float]] = []
        self._unslowed_index = 0  # the plan agreed for "no deadline", to go back to
        self._last_iteration = -1

    @property
    def plan(self) -> Plan:
        return self.frontier.plans[self.index]

    def stage_clocks(self, stage: int, index: int | None = None) -> tuple[int, ...]:
        """The clocks of `stage` (this rank's: its plan table's) in its execution order, of the
        deployed plan or of plan `index` (cached per plan)."""
        if stage != self.table.stage:
            raise IndexError(f"this rank holds stage {self.table.stage}'s clocks, not stage {stage}'s")
        index = self.index if index is None else index
        key = (index, stage)
        clocks = self._clock_cache.get(key)
        if clocks is None:
            clocks = self._clock_cache[key] = self.table.clocks(index)
        return clocks

    def stage_durations(self, stage: int) -> tuple[float, ...] | None:
        """The deployed plan's planned duration of each computation of `stage` (from the profile
        the frontier was solved with; None without one), for issuing clock changes ahead."""
        if self.measured is None:
            return None
        key = (self.index, -1 - stage)
        durations = self._clock_cache.get(key)
        if durations is None:
            profile = self.measured.profile
            durations = tuple(
                float(profile[stage, c.kind.value].times[profile[stage, c.kind.value].index_of(clock)])
                for c, clock in zip(self.schedule.orders[stage], self.stage_clocks(stage))
            )
            self._clock_cache[key] = durations
        return durations

    @property
    def factor(self) -> float:
        """The slowdown the deployed plan was chosen for (the tracker's may be a check ahead)."""
        return self._plan_factor

    def iteration_setting(self, iteration: int, deployed_iterations: int, probes: BaselineProbes,
                          fell_back: bool) -> IterationSetting:
        """What a deployed iteration runs: the plan, or default clocks on a rank that fell back
        or in a baseline probe -- decided from the deployed-iteration count and the pipeline's
        last plan switch, the same on every rank (a probe's setting has no plan, so it runs and
        is recorded at default clocks)."""
        since_switch = iteration - self.switches[-1].iteration - 1 if self.switches else None
        probe = not fell_back and probes.is_probe(deployed_iterations, since_switch)
        return IterationSetting(iteration, Phase.DEPLOYED, plan=None if fell_back or probe else self.index,
                                factor=self.factor, fell_back=fell_back, probe=probe)

    def recovery_program(self, setting: IterationSetting) -> RecoveryProgram | None:
        """At a deployed iteration's start: when a plan slowed for a measured straggler is in
        force, the judge is told what the iteration runs (non-blocking), and the fastest plan's
        clocks come back as the iteration's recovery program (None: nothing to recover from, or a
        baseline probe, which runs default clocks anyway)."""
        if self.episode is None or self._held is None or setting.fell_back:
            return None
        extra = self._planned_time(setting) - self.frontier.fastest.time
        self.judge.expect(HeldIteration(setting.iteration, self.episode, self._held, self._episode_free_wait_s,
                                        extra, setting.plan == self.index))
        if setting.plan is None:
            return None
        return RecoveryProgram(self.episode, self.stage_clocks(self.table.stage, self._unslowed_index))

    def deploy(self, iteration: int) -> None:
        """First deployment (every rank of the job, same iteration); announced slowdowns count
        from the first straggler check on."""
        self._agree(iteration, None, factor=1.0, reason="deploy")

    def on_iteration(self, iteration: int, records: list[IterationRecord], announced: SlowdownAnnouncement | None) -> None:
        """End of a deployed iteration on every rank: go back to the fastest plan when a verdict
        says this pipeline has become the slowest, feed records, move the straggler checks in
        flight one step on, start a check when due. Never waits for the device."""
        self._last_iteration = iteration
        returned = self._learn(iteration)
        self._ingest(records)
        for stale in [i for i in self._records if i < iteration - RECORD_KEEP]:
            del self._records[stale]
        self._deployed_iterations += 1
        for check in list(self._checks):
            if check.advance(iteration):
                self._checks.remove(check)
        interval = self.config.straggler_check_interval
        if (self._deployed_iterations + CHECK_BOUNDARIES) % interval == 0:
            self._start_check(announced)
        if returned or self._deployed_iterations % interval == 0:
            return  # a straggler check's plan switch lands here
        if self._policy_check_at is not None and self._deployed_iterations >= self._policy_check_at:
            self._agree(iteration, self._deadline, factor=self.tracker.factor,
                        reason=f"{self.policy.name} re-evaluated (period {self.policy.period_s:g} s)")

    def _ingest(self, records: list[IterationRecord]) -> None:
        """Device records in: straggler-check times, recent iteration times, free waits."""
        fastest = self.frontier.fastest.time
        for record in records:
            self._recent_times.append(record.time_s)
            self._records[record.iteration] = record
            if record.iteration in self._overridden:
                continue  # not the plan its setting names: the override ran it (partly) at the fastest plan's clocks
            if record.setting.plan is not None and not record.setting.fell_back:
                planned = self.frontier.plans[record.setting.plan].time
                self._check_times.append(record.compute_s - (planned - fastest))
                if record.setting.plan == self._unslowed_index and record.setting.factor == 1.0:
                    self._unvetted_free.append((record.iteration, record.time_s - record.compute_s))
                    if record.first_computation_s is not None and planned > 0:
                        self._model_ratios.append((record.compute_s - record.first_computation_s) / planned)
                        del self._model_ratios[:-MODEL_SAMPLES]
        del self._recent_times[:-10]

    def _learn(self, iteration: int) -> bool:
        """The episode's verdict, if one came (never waits): the fastest plan from the next
        iteration on, at the first boundary `RETURN_BOUNDARIES` after the iteration that told --
        the same boundary on every rank of the pipeline whenever the verdict is in by then (the
        device ran the fastest plan's clocks meanwhile). True when this pipeline returned."""
        if self.episode is None:
            return False
        if self._verdict is None or self._verdict.episode != self.episode:
            self._verdict = self.judge.take(self.episode)
        verdict = self._verdict
        if verdict is None or iteration < verdict.iteration + RETURN_BOUNDARIES:
            return False
        self._verdict = None
        self._overridden = range(verdict.iteration, iteration + 1)
        self.tracker.recovered()
        self._hold(None)
        self._deadline = None
        self._returns += 1
        self._plan_factor = 1.0
        self._switch(iteration, self._unslowed_index, factor=1.0,
                     reason=f"{verdict.reason}; the device has run the fastest plan's clocks since")
        return True

    def _hold(self, held: HeldStraggler | None, window_start: int = 0) -> None:
        """A check's measured straggler holds this pipeline (None: not, or no longer): a plan
        slowed for it begins or renews a straggler episode, which the judge and the straggler's
        post can end. `window_start`: the first iteration the check measured; a post of a
        recovery before the episode's first check began measuring is not this straggler's."""
        if held is None or self.index == self._unslowed_index:
            self.episode, self._held = None, None
        elif self.episode is None:
            self.episode, self._held = self.judge.new_episode(), held
            self._episode_free_wait_s = self.free_waits.free_wait_s
            if self.signal is not None:
                self.signal.arm_held(self.episode, window_start)
        else:
            self._held = held
        if self.signal is not None and self.episode is None:
            self.signal.arm_held(None)

    def _straggler_gone(self, lead_s: float) -> bool:
        """Whether this rank's latest unslowed iteration waited at the gradient sync for less
        than half the straggler's `lead_s` the check measured: its measurements reach back before
        the straggler recovered (a check window spans `straggler_check_interval` iterations), so
        slowing down now would slow the job. Only the pipeline leader's view picks the plan."""
        latest = max((r for r in self._records.values() if not r.setting.fell_back
                      and r.setting.plan in (None, self._unslowed_index)), key=lambda r: r.iteration, default=None)
        if latest is None or not self.free_waits.has_free_wait:
            return False
        extra = self._planned_time(latest.setting) - self.frontier.fastest.time
        return latest.time_s - latest.compute_s < self.free_waits.free_wait_s + 0.5 * (lead_s - extra)

    def _planned_time(self, setting: IterationSetting) -> float:
        """The model time of what an iteration ran: its plan, or all max clocks (a probe)."""
        return self.frontier.plans[setting.plan].time if setting.plan is not None else self.frontier.baseline.time

    def _start_check(self, announced: SlowdownAnnouncement | None) -> None:
        own = statistics.median(self._check_times) if self._check_times else None
        self._check_times = []
        announced = announced or SlowdownAnnouncement()
        exchange = StragglerExchange(self.comm, own, announced.factor, announced.time_s, self.free_waits.noise_s)
        self._checks.append(_CheckInFlight(self, exchange, self._returns, self._last_iteration + 1))

    def _decide(self, exchanged: ExchangeResult, returns_at_start: int, window_end: int) -> _Decision | None:
        """A check's exchanged times -> the slowdown to plan for; None keeps the plan (no device
        record yet on this pipeline). Sets the deadline the policy plans for. A check whose
        measurements began before this pipeline last went back to its fastest plan may keep or
        lower the slowdown, never raise it (they describe the straggler that has gone)."""
        mine, normal, slowest, factor_announced, time_announced, wait_noise = exchanged
        self._checks_decided += 1
        if mine is None:
            return None
        self._check_model()
        if self.signal is not None:  # the slowest pipeline, by more than the threshold: it posts its recovery
            straggler_here = mine >= slowest and slowest - normal > self.config.straggler_threshold * self.frontier.fastest.time
            self.signal.arm_straggler(self._checks_decided if straggler_here else None,
                                      window_end - self.config.straggler_check_interval)
        straggler = max(slowest, factor_announced * normal, time_announced)
        # This pipeline may take (straggler - mine) longer without slowing the job down.
        ratio = 1.0 + (straggler - mine) / self.frontier.fastest.time
        if ratio < 1.0 + self.config.straggler_threshold:  # nobody to wait for in the check's window
            for iteration, wait in self._unvetted_free:
                if iteration < window_end:
                    self.free_waits.observe_free(iteration, wait)
            self._unvetted_free = [(i, w) for i, w in self._unvetted_free if i >= window_end]
        else:
            self._unvetted_free = []
        if returns_at_start != self._returns or (ratio > self.tracker.factor and self._straggler_gone(slowest - mine)):
            ratio = min(ratio, self.tracker.factor)
        self.tracker.update(ratio)
        factor = self.tracker.factor
        # The held factor may be up to `hysteresis` above the latest ratio; planning that much
        # below it keeps this pipeline from ever becoming the slowest one. The plan also ends a
        # few of the pipeline's wait spreads early, so that the wait it leaves at the gradient
        # sync shows when the straggler recovers (`RecoveryWatch`); 0 on a deterministic device.
        fastest = self.frontier.fastest.time
        margin_s = max(self.config.straggler_hysteresis * fastest, NOISE_MARGINS * wait_noise)
        self._deadline = None if factor <= 1.0 else fastest * factor - margin_s
        measured = slowest >= straggler and factor > 1.0
        held = HeldStraggler(slowest, mine, wait_noise) if measured else None
        return _Decision(factor, f"slowest pipeline {straggler:.4f} s, this one {mine:.4f} s", held)

    def _check_model(self) -> None:
        """Straggler targets are model times: warn once when the model misjudges pipeline 0's
        computations (a profile that does not describe this job), as plans would be off by as
        much. Measured on the pipeline's leader, stage 0, from its first computation's start to
        its last one's end: the pipeline's first and last computations are stage 0's, and what
        precedes the first (data loading, the host's launch) is no computation's."""
        if self._model_warned or len(self._model_ratios) < 3 or self.comm.pipeline != 0:
            return
        ratio = statistics.median(self._model_ratios)
        if not self.comm.is_pipeline_leader or abs(ratio - 1) <= MODEL_DISAGREEMENT:
            return
        self._model_warned = True
        plan = self.frontier.plans[self._unslowed_index]
        logger.warning("perseus-ext: the frontier models the deployed plan's computations at %.4f s per iteration, "
                       "pipeline 0 measures %.4f s (%+.0f%%, its first computation's start to its last one's end); "
                       "straggler plans will be off by as much -- is the profile (%s.profile_path) from this job?",
                       plan.time, plan.time * ratio, 100 * (ratio - 1), "perseus")

    def _agree(self, iteration: int, deadline: float | None, *, factor: float, reason: str) -> None:
        """Deploy the pipeline leader's choice on every rank of the pipeline, at once (the first
        deployment and policy re-evaluations; straggler checks broadcast without waiting)."""
        choice: PlanChoice = self.comm.broadcast_pipeline(self._propose(deadline))
        self._apply(iteration, choice, factor=factor, reason=reason)

    def _propose(self, deadline: float | None) -> PlanChoice | None:
        """The plan for `deadline` and when to evaluate again; only the pipeline leader's counts.

        Every rank evaluates the policy (which keeps its own carbon reading current for its
        emissions ledger), but ranks may read a time-varying signal at slightly different
        moments, so only the leader's plan counts. The leader also says when to evaluate again:
        every `period_s` seconds, converted to iterations with its recent iteration time."""
        offered = self._ordinary if deadline is None else self.frontier
        try:
            chosen = self._index_of[id(self.policy.select(offered, deadline))]
        except Exception as err:  # a failing policy must not skip the broadcast
            logger.error("perseus-ext: the %s policy failed (%r); deploying the fastest plan",
                         getattr(self.policy, "name", "?"), err)
            chosen = 0
        return PlanChoice(chosen, self._policy_interval()) if self.comm.is_pipeline_leader else None

    def _apply(self, iteration: int, choice: PlanChoice, *, factor: float, reason: str) -> None:
        self._plan_factor = factor
        interval = choice.reevaluate_in_iterations
        self._policy_check_at = None if interval is None else self._deployed_iterations + interval
        if self._deadline is None:
            self._unslowed_index = choice.index
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
        start = self.frontier.extension_start
        if start is not None and index >= start:
            reason += "; wait-aware plan"
        self.switches.append(PlanSwitch(iteration, index, factor, reason, plan.time, plan.energy))
        if self.comm.is_pipeline_leader:
            logger.info("perseus-ext: pipeline %d iteration %d: plan %d/%d (%s): model time "
                        "%.4f s, energy %.1f J (fastest %.4f s, all-max-clock %.1f J)",
                        self.comm.pipeline, iteration, index, len(self.frontier.plans), reason,
                        plan.time, plan.energy, self.frontier.fastest.time, self.frontier.baseline.energy)


class _CheckInFlight:
    """One straggler check spread over the `CHECK_BOUNDARIES` iteration boundaries after the
    one that started it: the two reductions of `StragglerExchange`, then the leader's plan
    broadcast (two floats: plan index, re-evaluation interval or -1). Nothing waits on a round
    trip: each collective had a whole iteration to finish. The plan switches at the last
    boundary, on every rank of the pipeline alike."""

    def __init__(self, deployment: PlanDeployment, exchange: StragglerExchange, returns_at_start: int,
                 window_end: int) -> None:
        self._deployment = deployment
        self._exchange: StragglerExchange | None = exchange
        self._returns_at_start = returns_at_start
        self._window_end = window_end  # the first iteration its measurements cannot include
        self._choice: Pending | None = None
        self._decision: _Decision | None = None

    def advance(self, iteration: int) -> bool:
        """One step at this boundary; True when the check is over."""
        deployment = self._deployment
        if self._exchange is not None:
            exchanged = self._exchange.advance()
            if exchanged is None:
                return False
            self._exchange = None
            self._decision = deployment._decide(exchanged, self._returns_at_start, self._window_end)
            if self._decision is None:  # every rank of this pipeline agrees: the time is the pipeline's
                return True
            proposal = deployment._propose(deployment._deadline)
            values = None if proposal is None else [
                proposal.index, -1 if proposal.reevaluate_in_iterations is None else proposal.reevaluate_in_iterations]
            self._choice = deployment.comm.start_broadcast_pipeline(values, 2)
            return False
        index, interval = self._choice.result()
        decision = self._decision
        if deployment._returns != self._returns_at_start:
            # Measured before this pipeline found itself the slowest: the straggler they saw is gone.
            return True
        held = decision.held
        if held is not None and int(index) != deployment._unslowed_index and deployment.index == deployment._unslowed_index \
                and deployment._straggler_gone(held.slowest_s - held.mine_s):
            return True  # the straggler recovered since the check decided: no slowing down for it
        deployment._apply(iteration, PlanChoice(int(index), None if interval < 0 else int(interval)),
                          factor=decision.factor, reason=decision.reason)
        deployment._hold(decision.held, self._window_end - deployment.config.straggler_check_interval)
        return True


@dataclass(frozen=True)
class _Decision:
    """A straggler check's outcome on one rank: the slowdown planned for, why, and the measured
    straggler it holds this pipeline for (None: none measured, e.g. an announced one, which
    only its withdrawal ends)."""

    factor: float
    reason: str
    held: HeldStraggler | None


@dataclass(frozen=True)
class SlowdownAnnouncement:
    """A cluster manager's word on the slowest pipeline: a factor of the normal (fastest
    pipeline's) iteration time, or an absolute iteration time; 0 where not given."""

    factor: float = 0.0
    time_s: float = 0.0


def parse_announcement(factor_or_time: float | datetime.timedelta | None) -> SlowdownAnnouncement | None:
    """A cluster manager's straggler announcement: a factor of the normal iteration time, an
    absolute iteration time, or None to withdraw it."""
    if factor_or_time is None:
        return None
    if isinstance(factor_or_time, datetime.timedelta):
        seconds = factor_or_time.total_seconds()
        if seconds <= 0:
            raise PerseusError(f"announced iteration time must be positive, got {factor_or_time}")
        return SlowdownAnnouncement(time_s=seconds)
    factor = float(factor_or_time)
    if not math.isfinite(factor) or factor < 1.0:
        raise PerseusError(f"announced slowdown factor must be >= 1.0, got {factor_or_time!r}")
    return SlowdownAnnouncement(factor=factor)
