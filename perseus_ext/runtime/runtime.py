"""The framework-agnostic Perseus lifecycle that adapters drive from their pipeline hooks.

warm-up (default clocks) -> profiling (candidate clocks, all stages in parallel, early stop)
-> solving (frontier solved off the training thread, training goes on at default clocks)
-> deployed (fastest plan; straggler checks every N iterations move to slower plans and back).
With `policy.mode: "power_limit"` (Zeus' global knob, also for jobs without pipeline parallelism)
the clocks stay at their defaults and warm-up is followed by the power-limit phase instead: every
rank walks the same GPU power limits, the job-wide cost picks one, and it is restored at close.

Adapters call, on every rank: `iteration_start()`, `before_computation()` /
`after_computation()` around every forward and backward, optionally `mark_compute_end()` right
before the gradient all-reduce and `before_communication()` before blocking receives, and
`iteration_end()`. Phase changes are decided from collective results only, so every rank changes
phase at the same iteration and the runtime's own collectives always match up. Nothing here ever
raises into the training step: a failure logs once and the rank falls back to default clocks
while still taking part in the collectives, so it cannot hang the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import enum
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

from perseus_ext.errors import ConfigError, PerseusError
from perseus_ext.measurement.gpu import GPU, GPUError, SimulatedGPU, open_gpu
from perseus_ext.measurement.windows import EnergyMeter
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule
from perseus_ext.policies import CarbonLedger, PolicyConfig, PowerLimitOptimizer
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.chase import CarbonCost
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.runtime.config import PREFIX, PerseusConfig
from perseus_ext.runtime.profiler import StageMeasurements, StageProfiler
from perseus_ext.runtime.solver_process import BackgroundSolve, solve
from perseus_ext.runtime.straggler import SlowdownTracker

logger = logging.getLogger(__name__)

SIM_FLUSH_TIMEOUT_S = 1.0


class Phase(str, enum.Enum):
    WARMUP = "warmup"
    PROFILING = "profiling"
    SOLVING = "solving"
    DEPLOYED = "deployed"
    POWER_LIMIT = "power_limit"  # policy.mode power_limit: profiling, then holding one GPU power limit
    OBSERVING = "observing"  # default clocks for the rest of the run (observe mode or fallback)


def profile_sidecar(path: str | Path) -> Path:
    """Where the blocking power measured with a saved profile is kept (the CSV has no column)."""
    return Path(f"{path}.json")


def _frontier_policy(parsed: PolicyConfig | None, gpu: GPU | None) -> OperatingPointPolicy:
    """The parsed `policy` sub-section as a frontier policy (None: Perseus' straggler policy).
    Cost policies (Zeus, Chase) price time at one GPU's maximum power limit, read from `gpu`
    unless the section sets `max_power_w`."""
    if parsed is None:
        return StragglerPolicy()
    max_power = None
    if gpu is not None and parsed.max_power_w is None:
        max_power = float(gpu.power_limit_range_w()[1])
    return parsed.build_policy(max_power)


class ControlledPowerLimits:
    """The power-limit optimizer's view of one GPU: limits go through the rank's
    FrequencyController, so they are applied off the training thread and restored on close,
    exit, signals and (watchdog) SIGKILL like clocks are. After `release()` (the rank fell back)
    the initial limit is back and further limits are ignored, while the optimizer keeps joining
    its all-reduces so the other ranks never wait for this one."""

    def __init__(self, gpu: GPU, controller: Any, initial_w: float, settle: Callable[[], None]) -> None:
        self.gpu = gpu
        self.controller = controller
        self.initial_w = initial_w
        self.requested_w = initial_w
        self.released = False
        self._settle = settle

    def power_limit_range_w(self) -> tuple[float, float]:
        return self.gpu.power_limit_range_w()

    def set_power_limit_w(self, watts: float) -> None:
        if self.released:
            return
        self.controller.set_power_limit(watts)
        self.requested_w = float(watts)
        self._settle()

    def reset_power_limit(self) -> None:
        self.controller.set_power_limit(self.initial_w)
        self.requested_w = self.initial_w
        self._settle()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.reset_power_limit()


class PerseusRuntime:
    """One rank's Perseus lifecycle (see the module docstring for the hook protocol)."""

    def __init__(
        self,
        config: PerseusConfig,
        *,
        schedule: PipelineSchedule,
        stage: int,
        dp_group: Any = None,
        pp_group: Any = None,
        gpu: GPU | None = None,
        policy: OperatingPointPolicy | None = None,
        local_rank: int = 0,
    ) -> None:
        if not 0 <= stage < schedule.num_stages:
            raise PerseusError(f"stage {stage} is outside the schedule's 0..{schedule.num_stages - 1}")
        self.config = config
        self.schedule = schedule
        self.stage = stage
        self.order: tuple[Computation, ...] = schedule.orders[stage]
        self._check_pipeline_rank(pp_group)
        if config.simulated_workload is not None:
            config.simulated_workload.check_stages(schedule.num_stages)
        self.gpu = gpu if gpu is not None else self._open_gpu(local_rank)
        self._simulated = isinstance(self.gpu, SimulatedGPU)
        if config.simulated_workload is not None and not self._simulated:
            raise ConfigError(
                f"{PREFIX}.simulated_workload only applies to a simulated GPU; set {PREFIX}.gpu "
                f"to 'sim:<preset>' or remove {PREFIX}.simulated_workload"
            )
        if self._simulated and config.simulated_workload is None:
            logger.warning("perseus-ext: simulated GPU without %s.simulated_workload: computations "
                           "are not paced, so energy reflects idle power only", PREFIX)
        self.candidate_clocks, self.communication_clock = self._check_clocks()
        self.policy_config: PolicyConfig | None = (
            PolicyConfig.parse(dict(config.policy)) if config.policy is not None else None
        )
        self.power_limit_mode = self.policy_config is not None and self.policy_config.mode == "power_limit"
        if self.power_limit_mode:
            if policy is not None:
                raise ConfigError(f"{PREFIX}.policy.mode 'power_limit' picks a power limit, not frontier "
                                  f"plans; drop the policy object or set {PREFIX}.policy.mode 'frontier'")
            self._check_power_limits()
            self.policy: OperatingPointPolicy | None = None
        else:
            self.policy = policy if policy is not None else _frontier_policy(self.policy_config, self.gpu)
        self.saved_profile = self._check_saved_profile()
        self.solver_options = self._check_solver_options()

        from perseus_ext.actuation.controller import FrequencyController

        self.controller = FrequencyController(self.gpu, dry_run=config.dry_run, strict=config.strict)
        if self.controller.dry_run:
            why = "as configured" if config.dry_run else "no permission to set GPU clocks"
            logger.warning("perseus-ext: stage %d runs in DRY-RUN mode (%s): clock changes are "
                           "recorded, not applied", stage, why)
        self.meter = EnergyMeter(self.gpu) if self.gpu is not None else None
        self._now: Callable[[], float] = self.gpu.timestamp if self.gpu is not None else time.perf_counter
        self.comm = ControlPlane(stage=stage, dp_group=dp_group, timeout_s=config.control_timeout_s)
        self.profiler: StageProfiler | None = None
        self.tracker = SlowdownTracker(config.straggler_threshold, config.straggler_hysteresis,
                                       config.straggler_confirmations)

        self.phase = Phase.WARMUP if config.mode == "optimize" else Phase.OBSERVING
        self.iteration = 0
        self.frontier: Frontier | None = None
        self.plan: Plan | None = None
        self.history: list[dict[str, Any]] = []
        self.plan_switches: list[dict[str, Any]] = []
        self.fallback_reason: str | None = None
        self.profiling_iterations = 0
        self.profile_overhead_s = 0.0
        self._phase_iterations = 0
        self._deployed_iterations = 0
        self._check_times: list[float] = []
        self._announced: tuple[str, float] | None = None
        self._solver: BackgroundSolve | None = None
        self._solve_result: dict[str, Any] | None = None
        self._solve_started = 0.0
        self._iteration_clocks: tuple[int, ...] | None = None
        self._clock_locked = False
        self._requested_clock: int | None = None
        self._position = 0
        self._computation_start = 0.0
        self._iteration_start = 0.0
        self._iteration_start_mj: int | None = None
        self._compute_end: float | None = None
        self._closed = False
        self._summary: dict[str, Any] | None = None
        # Policy agreement: the deadline of the latest straggler check and the deployed
        # iteration at which a time-varying policy (Chase) is evaluated again.
        self._deadline: float | None = None
        self._policy_check_at: int | None = None
        # Power-limit mode.
        self.power_limits: ControlledPowerLimits | None = None
        self.limit_optimizer: PowerLimitOptimizer | None = None
        self.power_limit_switches: list[dict[str, Any]] = []
        # Emissions accounting (Chase): this GPU's mean energy per iteration at default settings.
        self._carbon_ledger: Any = None
        self._default_energy_sum = 0.0
        self._default_energy_count = 0
        self._log_file = self._open_log(config.log_path)
        logger.info(
            "perseus-ext: stage %d/%d pipeline %d ready on %s (%s); %d candidate clocks",
            stage, schedule.num_stages, self.comm.pipeline,
            self.gpu.name if self.gpu is not None else "no GPU",
            "dry-run" if self.controller.dry_run else "live", len(self.candidate_clocks),
        )

    # ------------------------------------------------------------------ setup helpers
    def _check_pipeline_rank(self, pp_group: Any) -> None:
        if pp_group is None:
            return
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank(pp_group) != self.stage:
            raise PerseusError(
                f"stage {self.stage} is rank {dist.get_rank(pp_group)} of its pipeline group; "
                f"perseus-ext expects pipeline-group ranks ordered by stage"
            )

    def _open_gpu(self, local_rank: int) -> GPU | None:
        try:
            return open_gpu(self.config.gpu, local_rank=local_rank, seed=self.config.seed)
        except GPUError as err:
            logger.warning("perseus-ext: cannot open the GPU (%s); DRY-RUN at default clocks", err)
            return None

    def _check_clocks(self) -> tuple[list[int], int | None]:
        if self.gpu is None:
            return [], None
        supported = self.gpu.supported_sm_clocks()
        listed = self.config.candidate_clocks
        for clock in listed or ():
            if clock not in supported:
                raise ConfigError(self._unsupported(f"{PREFIX}.candidate_clocks", clock, supported))
        base = list(listed) if listed is not None else list(supported)
        candidates = base[:: self.config.clock_stride]
        comm = self.config.communication_clock
        if comm == "min":
            comm = supported[-1]
        elif comm is not None and comm not in supported:
            raise ConfigError(self._unsupported(f"{PREFIX}.communication_clock", comm, supported))
        return candidates, comm

    def _unsupported(self, key: str, clock: int, supported: list[int]) -> str:
        nearest = min(supported, key=lambda c: abs(c - clock))
        return (f"{key}: {clock} MHz is not supported by {self.gpu.name} (supported "
                f"{supported[-1]}-{supported[0]} MHz; nearest {nearest} MHz)")

    def _check_power_limits(self) -> None:
        """Explicit `policy.power_limit.limits_w` must fit this GPU (checked now, not at the end
        of warm-up inside a training step)."""
        listed = self.policy_config.power_limit.get("limits_w")
        if listed is None or self.gpu is None:
            return
        low, high = self.gpu.power_limit_range_w()
        outside = [w for w in listed if not low <= w <= high]
        if outside:
            raise ConfigError(f"{PREFIX}.policy.power_limit.limits_w: {outside} W outside {self.gpu.name}'s "
                              f"power-limit range {low:g}-{high:g} W")

    def _check_saved_profile(self) -> tuple[Profile, float] | None:
        path = self.config.profile_path
        if path is None or not Path(path).is_file():
            return None
        profile = load_profile(path)
        if profile.num_stages != self.schedule.num_stages:
            raise ConfigError(
                f"{PREFIX}.profile_path {path} profiles {profile.num_stages} stages, this pipeline "
                f"has {self.schedule.num_stages}; delete it to profile again"
            )
        blocking = self.config.blocking_power_w
        sidecar = profile_sidecar(path)
        if blocking is None and sidecar.is_file():
            blocking = float(json.loads(sidecar.read_text())["blocking_power_w"])
        if blocking is None:
            raise ConfigError(
                f"{PREFIX}.profile_path {path} has no blocking power ({sidecar} is missing); "
                f"set {PREFIX}.blocking_power_w"
            )
        return profile, blocking

    def _check_solver_options(self) -> Any:
        section = self.config.solver
        if section is None:
            return None
        from perseus_ext.planning.solver import SolverOptions

        known = {f.name for f in dataclasses.fields(SolverOptions)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(f'{PREFIX}.solver.{k}' for k in unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        for key, value in section.items():
            default = getattr(SolverOptions, key)
            if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{PREFIX}.solver.{key} must be a {type(default).__name__}, got {value!r}")
        return SolverOptions(**section)

    def _open_log(self, template: str | None):
        if template is None:
            return None
        path = Path(template.format(rank=self.comm.rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w")

    # ------------------------------------------------------------------ hooks
    def iteration_start(self) -> None:
        """Start measuring an iteration and pick its clocks."""
        if self._closed:
            return
        try:
            self._position = 0
            self._compute_end = None
            self._iteration_clocks = self._clocks_for_iteration()
            if self._iteration_clocks is None and self._clock_locked:
                self._release_clock()
            else:
                self._request_clock(self._planned_clock())
            self._iteration_start, self._iteration_start_mj = self._read_energy()
            if self._profiling_now:
                self.profiler.on_counter(self._iteration_start, self._iteration_start_mj)
        except Exception as err:  # never break the training step
            self.fall_back(f"iteration_start failed: {err!r}")

    def before_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """Enqueue the planned clock of the next computation (never blocks on a real GPU)."""
        if self._closed:
            return
        try:
            computation = Computation(self.stage, chunk, microbatch, Kind(kind))
            if self.fallback_reason is None:
                expected = self.order[self._position] if self._position < len(self.order) else None
                if computation != expected:
                    self.fall_back(
                        f"the framework ran {computation} where the {self.schedule.kind.value} "
                        f"schedule expects {expected if expected else 'no more computations'} "
                        f"(position {self._position}); is the configured schedule the one running?"
                    )
            clock = self._planned_clock()
            self._request_clock(clock)
            if self._simulated and clock is not None and self.controller.current_clock != clock:
                # Simulated kernels start synchronously on this thread, so the clock must be in
                # place first; real kernels are asynchronous and nothing waits here.
                self.controller.flush(SIM_FLUSH_TIMEOUT_S)
            if self._simulated:
                self.gpu.mark()
            elif self._profiling_now:
                self._synchronize_device()
            self._computation_start = self._now()
            if self._profiling_now:
                self.profiler.on_counter(*self._read_energy())
        except Exception as err:
            self.fall_back(f"before_computation failed: {err!r}")

    def after_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """Pace a simulated computation; record durations and energy while profiling."""
        if self._closed:
            return
        try:
            kind = Kind(kind)
            workload = self.config.simulated_workload
            if workload is not None:
                self.gpu.run(workload.seconds(self.stage, kind.value), kind.value)
            elif self._profiling_now:
                self._synchronize_device()
            end = self._now()
            clock = self._planned_clock()
            if self._profiling_now and clock is not None:
                self.profiler.on_computation(kind.value, clock, self._computation_start, end)
                self.profiler.on_counter(*self._read_energy())
            self._position += 1
            if self.communication_clock is None:
                # Ask for the next computation's clock now: the change happens while this rank
                # communicates, off the next computation's critical path.
                self._request_clock(self._planned_clock())
        except Exception as err:
            self.fall_back(f"after_computation failed: {err!r}")

    def before_communication(self) -> None:
        """Optionally drop to the communication clock while blocked on a receive/all-reduce."""
        if (self.communication_clock is not None and self.phase is Phase.DEPLOYED
                and self.fallback_reason is None and not self._closed
                and self._requested_clock != self.communication_clock):
            self.controller.set_clock(self.communication_clock)
            self._requested_clock = self.communication_clock
            self._clock_locked = True

    def mark_compute_end(self) -> None:
        """This pipeline's computations of the iteration are done; what follows is the
        data-parallel gradient wait, which straggler detection must not count."""
        if self._compute_end is None:
            self._compute_end = self._now()

    def iteration_end(self) -> None:
        """Log the iteration and advance the lifecycle (collectives on every rank)."""
        if self._closed:
            return
        try:
            end, end_mj = self._read_energy()
            disabled = getattr(self.controller, "disabled_reason", None)
            if self.fallback_reason is None and disabled is not None:
                self.fall_back(f"GPU clock control failed ({disabled})")
            if self.fallback_reason is None and self._position != len(self.order):
                self.fall_back(
                    f"the iteration ran {self._position} computations on stage {self.stage}, "
                    f"the schedule has {len(self.order)}"
                )
            compute_end = self._compute_end if self._compute_end is not None else end
            energy = (None if end_mj is None or self._iteration_start_mj is None
                      else (end_mj - self._iteration_start_mj) / 1000.0)
            self._record(end - self._iteration_start, compute_end - self._iteration_start, energy)
            self._account_carbon(energy)
        except Exception as err:
            self.fall_back(f"iteration_end failed: {err!r}")
        try:
            self._advance()
        except Exception as err:
            # Most likely a control-plane collective timed out (a rank died or stalled): the
            # groups are unusable, so stop all lifecycle collectives on this rank.
            self.fall_back(f"lifecycle step failed: {err!r}")
            self._set_phase(Phase.OBSERVING)
        self.iteration += 1

    # ------------------------------------------------------------------ cluster-manager API
    def announce_slowdown(self, factor_or_time: float | datetime.timedelta | None) -> None:
        """Announce the slowest pipeline's expected iteration time instead of waiting for it to
        be measured: a float is a factor of the normal (fastest pipeline's) iteration time, a
        timedelta an absolute iteration time, None withdraws the announcement. Takes effect at
        the next straggler check (every `straggler_check_interval` iterations)."""
        if factor_or_time is None:
            self._announced = None
        elif isinstance(factor_or_time, datetime.timedelta):
            seconds = factor_or_time.total_seconds()
            if seconds <= 0:
                raise PerseusError(f"announced iteration time must be positive, got {factor_or_time}")
            self._announced = ("time", seconds)
        else:
            factor = float(factor_or_time)
            if not math.isfinite(factor) or factor < 1.0:
                raise PerseusError(f"announced slowdown factor must be >= 1.0, got {factor_or_time!r}")
            self._announced = ("factor", factor)

    # ------------------------------------------------------------------ lifecycle
    @property
    def _profiling_now(self) -> bool:
        return (self.phase is Phase.PROFILING and self.fallback_reason is None
                and self.profiler is not None and not self.profiler.done)

    def _clocks_for_iteration(self) -> tuple[int, ...] | None:
        if self.fallback_reason is not None:
            return None
        if self._profiling_now:
            return (self.profiler.current_clock,) * len(self.order)
        if self.phase is Phase.DEPLOYED and self.plan is not None:
            return self.plan.frequencies[self.stage]
        return None

    def _planned_clock(self) -> int | None:
        clocks = self._iteration_clocks
        if clocks is None or self.fallback_reason is not None or self._position >= len(clocks):
            return None
        return clocks[self._position]

    def _advance(self) -> None:
        self._phase_iterations += 1
        if self.phase is Phase.WARMUP and self._phase_iterations >= self.config.warmup_iterations:
            self._end_warmup()
        elif self.phase is Phase.PROFILING:
            self._profiling_step()
        elif self.phase is Phase.SOLVING:
            self._solving_step()
        elif self.phase is Phase.DEPLOYED:
            self._deployed_step()
        elif self.phase is Phase.POWER_LIMIT:
            self._power_limit_step()

    def _end_warmup(self) -> None:
        if self.power_limit_mode:
            self._start_power_limit()
            return
        have_profile, can_set_clocks, none_fell_back = self.comm.all_min([
            float(self.saved_profile is not None),
            float(not self.controller.dry_run and bool(self.candidate_clocks)),
            float(self.fallback_reason is None),
        ])
        can_profile = can_set_clocks and none_fell_back
        if have_profile:
            logger.info("perseus-ext: using saved profile %s; skipping profiling", self.config.profile_path)
            self._start_solve(self.saved_profile if self.comm.is_pipeline_leader else None)
        elif can_profile:
            self.profiler = StageProfiler(
                self.stage, self.candidate_clocks,
                iterations_per_clock=self.config.profiling_iterations_per_clock,
                early_stop=self.config.early_stop, patience=self.config.early_stop_patience,
                blocking_power_w=self.config.blocking_power_w,
            )
            self._set_phase(Phase.PROFILING)
        elif not none_fell_back:
            logger.warning("perseus-ext: a rank fell back to default clocks during warm-up (its error "
                           "says why) and there is no saved profile (%s.profile_path): nothing to "
                           "profile, staying at default clocks", PREFIX)
            self._set_phase(Phase.OBSERVING)
        else:
            logger.warning("perseus-ext: some rank cannot set GPU clocks and there is no saved "
                           "profile (%s.profile_path): nothing to profile, staying at default "
                           "clocks", PREFIX)
            self._set_phase(Phase.OBSERVING)

    def _profiling_step(self) -> None:
        profiler = self.profiler
        if profiler.done or self.fallback_reason is not None:
            profiler.stop(self.fallback_reason or profiler.stop_reason)
        else:
            self.profiling_iterations += 1
            profiler.end_iteration()
        (all_done,) = self.comm.all_min([float(profiler.done)])
        if not all_done:
            return
        measurements: StageMeasurements | None = None
        # A rank that fell back cannot vouch for the clocks it was asked to run; its default
        # clock (the maximum) is real, so the planner keeps that stage at the maximum clock.
        clocks = None if self.fallback_reason is None else self.candidate_clocks[:1]
        try:
            measurements = profiler.measurements(clocks)
            self.profile_overhead_s = measurements.overhead_s
        except Exception as err:  # this stage's gap is reported by the pipeline leader
            level = logging.WARNING if self.fallback_reason else logging.ERROR  # cause logged already
            logger.log(level, "perseus-ext: stage %d: profiling produced no usable data (%s)", self.stage, err)
        (profiling_iterations,) = self.comm.all_max([self.profiling_iterations])
        logger.info("perseus-ext: profiling finished after %d iteration(s) (stage %d: %s; "
                    "framework overhead %.2f ms per computation)", int(profiling_iterations),
                    self.stage, profiler.stop_reason, 1000 * self.profile_overhead_s)
        gathered = self.comm.gather_pipeline(measurements)
        profile = None
        if self.comm.is_pipeline_leader:
            try:
                profile = self._assemble_profile(gathered)
                if profile is not None and self.comm.pipeline == 0 and self.config.profile_path:
                    self._save_profile(*profile)
            except Exception as err:  # leader-only work: failing it must not skip a collective
                logger.error("perseus-ext: pipeline %d: assembling the profile failed: %r",
                             self.comm.pipeline, err)
        self._start_solve(profile)

    def _assemble_profile(self, gathered: list) -> tuple[Profile, float] | None:
        """One pipeline's profile from its ranks' measurements (tensor-parallel peers of a stage
        add up their energy; the slowest peer sets the time)."""
        by_stage: dict[int, list[StageMeasurements]] = {}
        for member, measured in gathered:
            if measured is None:
                logger.warning("perseus-ext: rank %d (stage %d) has no profile; pipeline %d stays at "
                             "default clocks", member.rank, member.stage, member.pipeline)
                return None
            by_stage.setdefault(member.stage, []).append(measured)
        rows = []
        blocking = []
        for stage, peers in sorted(by_stage.items()):
            keys = set.intersection(*({(r["instruction"], r["frequency"]) for r in p.rows} for p in peers))
            for instruction, frequency in sorted(keys):
                matches = [next(r for r in p.rows if (r["instruction"], r["frequency"]) == (instruction, frequency)) for p in peers]
                rows.append({"stage": stage, "instruction": instruction, "frequency": frequency,
                             "time": max(r["time"] for r in matches),
                             "energy": sum(r["energy"] for r in matches)})
            blocking.append(sum(p.blocking_power_w for p in peers))
        blocking_power = self.config.blocking_power_w or statistics.fmean(blocking)
        try:
            return Profile.from_rows(rows, source=f"online profile of pipeline {self.comm.pipeline}"), blocking_power
        except PerseusError as err:
            logger.error("perseus-ext: pipeline %d profile is unusable: %s", self.comm.pipeline, err)
            return None

    def _save_profile(self, profile: Profile, blocking_power: float) -> None:
        path = Path(self.config.profile_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        profile_sidecar(path).write_text(json.dumps({
            "blocking_power_w": blocking_power,
            "gpu": self.gpu.name if self.gpu is not None else None,
            "schedule": self.schedule.describe(),
        }))
        logger.info("perseus-ext: saved the profile to %s (a restarted job skips profiling)", path)

    def _start_solve(self, profile: tuple[Profile, float] | None) -> None:
        self._set_phase(Phase.SOLVING)
        if not self.comm.is_pipeline_leader:
            return
        self._solve_started = time.perf_counter()
        if profile is None:
            self._solve_result = {"error": "no usable profile"}
        elif self.config.solve_in_background:
            self._solver = BackgroundSolve(self.schedule, *profile, self.solver_options)
        else:
            self._solve_result = solve(self.schedule, *profile, self.solver_options)

    def _solving_step(self) -> None:
        if self.comm.is_pipeline_leader and self._solve_result is None and self._solver is not None:
            self._solve_result = self._solver.result()
        ready = self._solve_result is not None if self.comm.is_pipeline_leader else True
        (all_ready,) = self.comm.all_min([float(ready)])
        if not all_ready:
            return
        result = self.comm.broadcast_pipeline(self._solve_result if self.comm.is_pipeline_leader else None)
        if "error" in result:
            logger.warning("perseus-ext: pipeline %d has no frontier (%s); staying at default clocks",
                         self.comm.pipeline, result["error"])
            self._set_phase(Phase.OBSERVING)
            return
        self.frontier = Frontier.from_dict(result["frontier"])
        if self.comm.is_pipeline_leader:
            logger.info("perseus-ext: pipeline %d frontier: %d plans, solved in %.1f s while training "
                        "went on; the fastest plan saves %.1f%% energy at no slowdown (model)",
                        self.comm.pipeline, len(self.frontier.plans),
                        time.perf_counter() - self._solve_started, 100 * self.frontier.intrinsic_saving())
            if self.comm.pipeline == 0 and self.config.frontier_path:
                try:
                    self.frontier.save(self.config.frontier_path)
                except OSError as err:
                    logger.error("perseus-ext: cannot save the frontier to %s: %s", self.config.frontier_path, err)
        self._agree_plan(None, factor=1.0, reason="deploy")
        self._set_phase(Phase.DEPLOYED)

    def _deployed_step(self) -> None:
        self._deployed_iterations += 1
        # What this iteration would have taken at the fastest plan: plans lengthen the compute
        # by their model time difference, while overheads (communication, optimizer) stay put.
        # A pipeline that slowed down on purpose therefore never looks like a straggler.
        self._check_times.append(
            self.history[-1]["compute_s"] - (self.plan.time - self.frontier.fastest.time)
        )
        if self._deployed_iterations % self.config.straggler_check_interval == 0:
            self._straggler_check()
        elif self._policy_check_at is not None and self._deployed_iterations >= self._policy_check_at:
            self._agree_plan(self._deadline, factor=self.tracker.factor,
                             reason=f"{self.policy.name} re-evaluated (period {self.policy.period_s:g} s)")

    def _straggler_check(self) -> None:
        own = statistics.median(self._check_times)
        self._check_times = []
        kind, value = self._announced or ("", 0.0)
        rows = self.comm.all_gather_floats([
            self.comm.pipeline, own,
            value if kind == "factor" else 0.0, value if kind == "time" else 0.0,
        ])
        pipeline_time: dict[int, float] = {}
        for pipeline, seconds, _, _ in rows:
            pipeline_time[int(pipeline)] = max(pipeline_time.get(int(pipeline), 0.0), seconds)
        mine = pipeline_time[self.comm.pipeline]
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
        # Re-selected at every check: cost policies (Chase's carbon price) change over time.
        self._agree_plan(self._deadline, factor=factor,
                         reason=f"slowest pipeline {straggler:.4f} s, this one {mine:.4f} s")

    def _agree_plan(self, deadline: float | None, *, factor: float, reason: str) -> None:
        """Deploy the pipeline leader's choice on every rank of the pipeline.

        Called by all ranks of a pipeline at the same iteration (deploy, straggler checks, and
        the iterations the leader scheduled for re-evaluation). Every rank evaluates the policy,
        which keeps its own carbon reading current for its emissions ledger, but ranks may read a
        time-varying signal at slightly different moments, so only the leader's plan index
        counts. The leader also says when to evaluate again: a time-varying policy wants it every
        `period_s` seconds, converted to iterations with the leader's recent iteration time."""
        try:
            chosen = self.frontier.plans.index(self.policy.select(self.frontier, deadline))
        except Exception as err:  # a failing policy must not skip the broadcast below
            logger.error("perseus-ext: the %s policy failed (%r); deploying the fastest plan",
                         getattr(self.policy, "name", "?"), err)
            chosen = 0
        proposal = (chosen, self._policy_interval()) if self.comm.is_pipeline_leader else None
        index, interval = self.comm.broadcast_pipeline(proposal)
        self._policy_check_at = None if interval is None else self._deployed_iterations + interval
        self._switch_plan(self.frontier.plans[index], factor=factor, reason=reason)

    def _policy_interval(self) -> int | None:
        """Deployed iterations until a time-varying policy is evaluated again (None: never,
        besides straggler checks)."""
        period = self.policy.period_s
        if period is None:
            return None
        recent = [r["time_s"] for r in self.history[-10:]]
        return max(1, int(period / max(statistics.median(recent), 1e-6))) if recent else 1

    # ------------------------------------------------------------------ power-limit mode
    def _start_power_limit(self) -> None:
        """End of warm-up in power-limit mode: every rank starts the optimizer, or none does."""
        initial_w = self._initial_power_limit()
        (can_control,) = self.comm.all_min([float(initial_w is not None)])
        optimizer = None
        if can_control:
            self.power_limits = ControlledPowerLimits(self.gpu, self.controller, initial_w, self._settle_power_limit)
            optimizer = self.policy_config.build_power_limit_optimizer(self.power_limits, all_reduce=self.comm.all_sum)
        (started,) = self.comm.all_min([float(optimizer is not None and optimizer.profiling)])
        if not started:
            if optimizer is not None:
                optimizer.close()
                optimizer.cost.close()
            self.power_limits = None
            logger.warning("perseus-ext: some rank cannot set its GPU power limit (dry-run, no GPU, a "
                           "fallback or an unreadable limit): staying at the default power limit")
            self._set_phase(Phase.OBSERVING)
            return
        self.limit_optimizer = optimizer
        if isinstance(optimizer.cost, CarbonCost):
            self._carbon_ledger = CarbonLedger(optimizer.cost)
        if self.comm.rank == 0:
            logger.info("perseus-ext: power-limit mode (%s, eta %g): profiling limits from %.0f W down",
                        self.policy_config.type, self.policy_config.eta, optimizer.limit_w)
        self._set_phase(Phase.POWER_LIMIT)

    def _initial_power_limit(self) -> float | None:
        """This rank's current power limit (restored at the end), or None when it cannot take
        part: dry-run, no GPU, a fallback or an unreadable limit."""
        if self.gpu is None or self.controller.dry_run or self.fallback_reason is not None:
            return None
        try:
            return float(self.gpu.power_limit_w())
        except Exception as err:
            logger.warning("perseus-ext: rank %d cannot read its GPU power limit: %s", self.comm.rank, err)
            return None

    def _settle_power_limit(self) -> None:
        """A simulated GPU runs the next computation synchronously: the limit must be in place."""
        if self._simulated:
            self.controller.flush(SIM_FLUSH_TIMEOUT_S)

    def _power_limit_step(self) -> None:
        """Feed the iteration to the optimizer (collective while it profiles: all ranks call it)."""
        optimizer = self.limit_optimizer
        record = self.history[-1]
        was_profiling, before = optimizer.profiling, optimizer.limit_w
        energy = record["energy_j"] if record["energy_j"] is not None else math.nan
        limit = optimizer.on_iteration_end(record["time_s"], energy)
        if limit != before or (was_profiling and not optimizer.profiling):
            reason = "profiling" if optimizer.profiling else ("chosen" if was_profiling else "re-evaluated")
            self.power_limit_switches.append({"iteration": self.iteration, "limit_w": limit, "reason": reason})
            if not optimizer.profiling and self.comm.rank == 0:
                measured = {m.limit_w: m for m in optimizer.measurements}
                best = measured.get(limit)
                logger.info("perseus-ext: iteration %d: power limit %.0f W (%s %s, eta %g) after "
                            "profiling %d limits%s", self.iteration, limit, self.policy_config.type,
                            "re-evaluated" if not was_profiling else "chose", self.policy_config.eta,
                            len(optimizer.measurements),
                            f": {best.time_s:.4f} s, {best.energy_j:.1f} J per iteration (all GPUs)"
                            if best else "")

    # ------------------------------------------------------------------ emissions (Chase)
    def _account_carbon(self, energy_j: float | None) -> None:
        """Chase's emissions ledger, once per iteration: this GPU's energy against its mean
        energy per iteration at default settings (the warm-up and solving iterations; the
        first one carries one-off costs). Without such a measurement nothing is claimed saved."""
        if energy_j is None:
            return
        default_phase = self.phase in (Phase.WARMUP, Phase.SOLVING, Phase.OBSERVING)
        if default_phase and self.iteration > 0 and self.fallback_reason is None:
            self._default_energy_sum += energy_j
            self._default_energy_count += 1
        ledger = self._carbon_ledger
        if ledger is None:
            ledger = self.policy if hasattr(self.policy, "record_iteration") else None
        if ledger is None:
            return
        baseline = energy_j
        if not default_phase and self._default_energy_count:
            baseline = self._default_energy_sum / self._default_energy_count
        ledger.record_iteration(energy_j, baseline)

    def _switch_plan(self, plan: Plan, *, factor: float, reason: str) -> None:
        index = self.frontier.plans.index(plan) if plan in self.frontier.plans else -1
        if plan == self.plan:
            logger.debug("perseus-ext: pipeline %d: slowdown target x%.3f keeps plan %d (%s)",
                         self.comm.pipeline, factor, index, reason)
            return
        self.plan = plan
        self.plan_switches.append({
            "iteration": self.iteration, "plan": index, "factor": factor, "reason": reason,
            "plan_time_s": plan.time, "plan_energy_j": plan.energy,
        })
        if self.comm.is_pipeline_leader:
            logger.info("perseus-ext: pipeline %d iteration %d: plan %d/%d (%s): model time "
                        "%.4f s, energy %.1f J (fastest %.4f s, all-max-clock %.1f J)",
                        self.comm.pipeline, self.iteration, index, len(self.frontier.plans), reason,
                        plan.time, plan.energy, self.frontier.fastest.time, self.frontier.baseline.energy)

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._phase_iterations = 0

    def fall_back(self, reason: str) -> None:
        """Stop steering clocks (and the power limit) on this rank for good; it still joins
        every collective, so the other ranks carry on. Adapters call it when they cannot tell
        which computation the framework runs. Logs `reason` once; never raises."""
        if self.fallback_reason is not None:
            return
        self.fallback_reason = reason
        logger.error("perseus-ext: rank %d stage %d: %s; this rank runs at default clocks from now on",
                     self.comm.rank, self.stage, reason)
        try:
            self._release_clock()
            if self.power_limits is not None:
                self.power_limits.release()
        except Exception:  # the controller never raises, but a fallback must not either
            pass

    def _request_clock(self, clock: int | None) -> None:
        """Queue `clock` (non-blocking) unless it is already the requested one."""
        if clock is not None and clock != self._requested_clock:
            self.controller.set_clock(clock)
            self._requested_clock = clock
            self._clock_locked = True

    def _release_clock(self) -> None:
        """Back to the driver's default clocks."""
        self.controller.reset()
        if self._simulated:
            self.controller.flush(SIM_FLUSH_TIMEOUT_S)
        self._requested_clock = None
        self._clock_locked = False

    # ------------------------------------------------------------------ measurement
    def _read_energy(self) -> tuple[float, int | None]:
        if self.meter is None:
            return self._now(), None
        return self.meter.read()

    def _synchronize_device(self) -> None:
        """Profiling on a real GPU only: wait for queued kernels so host timestamps and energy
        reads bracket this computation. Deployed iterations never synchronise."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _record(self, seconds: float, compute_s: float, energy_j: float | None) -> None:
        if self.phase is Phase.DEPLOYED:
            plan = f"plan {self.frontier.plans.index(self.plan) if self.plan in self.frontier.plans else -1}"
        elif self._profiling_now:
            plan = f"profile@{self.profiler.current_clock}"
        elif self.phase is Phase.POWER_LIMIT and self.limit_optimizer.limit_w is not None:
            plan = f"limit {self.limit_optimizer.limit_w:g} W"
        else:
            plan = "default"
        record = {
            "iteration": self.iteration, "phase": self.phase.value, "plan": plan,
            "factor": self.tracker.factor if self.phase is Phase.DEPLOYED else None,
            "time_s": seconds, "compute_s": compute_s, "energy_j": energy_j,
            "rank": self.comm.rank, "pipeline": self.comm.pipeline, "stage": self.stage,
        }
        self.history.append(record)
        if self._log_file is not None:
            self._log_file.write(json.dumps(record) + "\n")
            self._log_file.flush()
        interval = self.config.log_interval
        if interval and self.iteration % interval == 0:
            level = logging.INFO if self.comm.rank == 0 else logging.DEBUG
            energy = f"{energy_j:.1f} J" if energy_j is not None else "n/a"
            logger.log(level, "perseus-ext: iteration %d [%s, %s] time %.4f s compute %.4f s "
                       "energy %s (rank %d)", self.iteration, self.phase.value, plan, seconds,
                       compute_s, energy, self.comm.rank)

    # ------------------------------------------------------------------ end of run
    def summary(self) -> dict[str, Any]:
        """Per-rank results: measured default-clock vs deployed iterations, the frontier's
        model figures, profiling cost and plan switches."""
        def stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
            if not records:
                return None
            energies = [r["energy_j"] for r in records if r["energy_j"] is not None]
            return {
                "iterations": len(records),
                "time_s": statistics.fmean(r["time_s"] for r in records),
                "energy_j": statistics.fmean(energies) if energies else None,
            }

        # The first iteration carries one-off costs (buffer allocation), so it is no baseline.
        default = [r for r in self.history[1:] if r["phase"] in ("warmup", "solving", "observing")]
        deployed = [r for r in self.history if r["phase"] == "deployed"]
        chosen_at = next((s["iteration"] for s in self.power_limit_switches if s["reason"] == "chosen"), None)
        if chosen_at is not None:  # power-limit mode: the iterations at the chosen limit
            deployed = [r for r in self.history if r["phase"] == "power_limit" and r["iteration"] > chosen_at]
        result: dict[str, Any] = {
            "rank": self.comm.rank, "pipeline": self.comm.pipeline, "stage": self.stage,
            "gpu": self.gpu.name if self.gpu is not None else None,
            "mode": self.config.mode, "dry_run": self.controller.dry_run,
            "fallback_reason": self.fallback_reason, "final_phase": self.phase.value,
            "iterations": len(self.history),
            "profiling_iterations": self.profiling_iterations,
            "profiled_clocks": self.profiler.profiled_clocks if self.profiler else [],
            "profile_overhead_s": self.profile_overhead_s,
            "default_clocks": stats(default),
            "deployed": stats(deployed),
            "deployed_intrinsic": stats([r for r in deployed if r["factor"] == 1.0]),
            "deployed_extrinsic": stats([r for r in deployed if r["factor"] and r["factor"] > 1.0]),
            "plan_switches": list(self.plan_switches),
            "controller_errors": self.controller.error_count,
            "policy": self._policy_summary(),
        }
        if self.frontier is not None:
            result["frontier"] = {
                "plans": len(self.frontier.plans),
                "all_max_clock": {"time_s": self.frontier.baseline.time, "energy_j": self.frontier.baseline.energy},
                "fastest": {"time_s": self.frontier.fastest.time, "energy_j": self.frontier.fastest.energy},
                "min_energy": {"time_s": self.frontier.min_energy.time, "energy_j": self.frontier.min_energy.energy},
                "intrinsic_saving": self.frontier.intrinsic_saving(),
            }
        base, dep = result["default_clocks"], result["deployed"]
        if base and dep and base["energy_j"] and dep["energy_j"]:
            result["energy_saving_vs_default"] = 1.0 - dep["energy_j"] / base["energy_j"]
            result["throughput_change"] = base["time_s"] / dep["time_s"] - 1.0
        return result

    def _policy_summary(self) -> dict[str, Any]:
        """Which policy ran; in power-limit mode the limits measured and the one chosen; with
        Chase this GPU's emissions (kgCO2 emitted, and saved against its default-clock energy)."""
        config = self.policy_config
        result: dict[str, Any] = {
            "mode": config.mode if config else "frontier",
            "type": config.type if config else (self.policy.name if self.policy else None),
        }
        if config is not None and config.type != "perseus":
            result["eta"] = config.eta
        optimizer = self.limit_optimizer
        if optimizer is not None:
            result.update(
                limit_w=None if optimizer.profiling else optimizer.limit_w,
                profiling=optimizer.profiling,
                measurements=[dataclasses.asdict(m) for m in optimizer.measurements],
                switches=list(self.power_limit_switches),
            )
        elif self.power_limit_mode:
            result.update(limit_w=None, profiling=False, measurements=[], switches=[])
        ledger = self._carbon_ledger if self._carbon_ledger is not None else self.policy
        report = getattr(ledger, "report", None)
        if report is not None:
            result["carbon"] = {**dataclasses.asdict(report), "summary": report.summary()}
        return result

    def close(self) -> None:
        """Restore default clocks and report; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        if self._solver is not None:
            self._solver.cancel()
        try:
            if self.policy is not None:
                self.policy.close()
            if self.limit_optimizer is not None:
                self.limit_optimizer.close()  # queues the initial limit through the controller
                self.limit_optimizer.cost.close()
                if self._carbon_ledger is not None and self._carbon_ledger.report.iterations:
                    logger.info("perseus-ext: rank %d chase: %s", self.comm.rank, self._carbon_ledger.report.summary())
        except Exception as err:
            logger.error("perseus-ext: closing the policy failed: %r", err)
        try:
            self.controller.close()
        except Exception as err:
            logger.error("perseus-ext: restoring clocks failed: %r", err)
        self._summary = self.summary()
        if self._log_file is not None:
            self._log_file.close()
        if self.config.summary_path:
            path = Path(self.config.summary_path.format(rank=self.comm.rank))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self._summary, indent=2))
        summary = self._summary
        if summary.get("energy_saving_vs_default") is not None:
            logger.info("perseus-ext: rank %d summary: %d iterations, profiling %d; energy/iteration "
                        "%.1f J -> %.1f J (%.1f%% saved), time/iteration %.4f s -> %.4f s",
                        summary["rank"], summary["iterations"], summary["profiling_iterations"],
                        summary["default_clocks"]["energy_j"], summary["deployed"]["energy_j"],
                        100 * summary["energy_saving_vs_default"], summary["default_clocks"]["time_s"],
                        summary["deployed"]["time_s"])
        else:
            logger.info("perseus-ext: rank %d summary: %d iterations, final phase %s",
                        summary["rank"], summary["iterations"], summary["final_phase"])
