"""`policy.mode: "power_limit"`: Zeus' global knob on the runtime's lifecycle.

Clocks stay at their defaults. After warm-up every rank walks the same GPU power limits, the
job-wide cost (energy summed over all ranks) picks one, and it is held -- re-evaluated when a
time-varying cost (Chase) changes -- and restored at close. Limits go through the rank's
FrequencyController, so they are applied off the training thread and restored on exit, signals
and SIGKILL like clocks are.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from perseus_ext.actuation.clock_control import ClockControl
from perseus_ext.measurement.gpu import GPU
from perseus_ext.config.policy import PolicySection
from perseus_ext.policies import CarbonLedger, PowerLimitOptimizer
from perseus_ext.policies.chase import CarbonCost
from perseus_ext.policies.factories import build_power_limit_optimizer
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.observability.iteration import IterationRecord

logger = logging.getLogger(__name__)


class ControlledPowerLimits:
    """The optimizer's view of one GPU. After `release()` (the rank fell back) the initial limit
    is back and further limits are ignored, while the optimizer keeps joining its all-reduces so
    the other ranks never wait for this one."""

    def __init__(self, gpu: GPU, controller: ClockControl, initial_w: float, settle: Callable[[], None]) -> None:
        self.gpu = gpu
        self.controller = controller
        self.initial_w = initial_w
        self.released = False
        self._settle = settle

    def power_limit_range_w(self) -> tuple[float, float]:
        return self.gpu.power_limit_range_w()

    def set_power_limit_w(self, watts: float) -> None:
        if not self.released:
            self.controller.set_power_limit(watts)
            self._settle()

    def reset_power_limit(self) -> None:
        self.controller.set_power_limit(self.initial_w)
        self._settle()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.reset_power_limit()


@dataclass(frozen=True)
class PowerLimitSnapshot:
    """Power-limit mode as the summary reports it: the limit in force (None while profiling),
    the limits measured, the limit switches and the iteration the limit was chosen at."""

    limit_w: float | None
    profiling: bool
    measurements: tuple[dict[str, Any], ...]
    switches: tuple[dict[str, Any], ...]
    chosen_at: int | None


class PowerLimitMode:
    """The power-limit optimizer of one rank, fed one device record per iteration."""

    def __init__(self, optimizer: PowerLimitOptimizer, limits: ControlledPowerLimits,
                 policy_config: PolicySection, comm: ControlPlane) -> None:
        self.optimizer = optimizer
        self.limits = limits
        self.policy_config = policy_config
        self.comm = comm
        self.switches: list[dict[str, Any]] = []
        self.carbon_ledger = CarbonLedger(optimizer.cost) if isinstance(optimizer.cost, CarbonCost) else None

    @classmethod
    def start(cls, gpu: GPU | None, controller: ClockControl, policy_config: PolicySection, comm: ControlPlane,
              *, can_take_part: bool, settle: Callable[[], None]) -> "PowerLimitMode | None":
        """End of warm-up, on every rank: all ranks start the optimizer, or none does."""
        initial_w = None
        if can_take_part and gpu is not None:
            try:
                initial_w = float(gpu.power_limit_w())
            except Exception as err:
                logger.warning("perseus-ext: rank %d cannot read its GPU power limit: %s", comm.rank, err)
        (can_control,) = comm.all_min([float(initial_w is not None)])
        limits = optimizer = None
        if can_control:
            limits = ControlledPowerLimits(gpu, controller, initial_w, settle)
            optimizer = build_power_limit_optimizer(policy_config, limits, all_reduce=comm.all_sum)
        (started,) = comm.all_min([float(optimizer is not None and optimizer.profiling)])
        if not started:
            if optimizer is not None:
                optimizer.close()
                optimizer.cost.close()
            logger.warning("perseus-ext: some rank cannot set its GPU power limit (dry-run, no GPU, a "
                           "fallback or an unreadable limit): staying at the default power limit")
            return None
        if comm.rank == 0:
            logger.info("perseus-ext: power-limit mode (%s, eta %g): profiling limits from %.0f W down",
                        policy_config.type, policy_config.eta, optimizer.limit_w)
        return cls(optimizer, limits, policy_config, comm)

    @property
    def limit_w(self) -> float | None:
        return self.optimizer.limit_w

    def step(self, iteration: int, record: IterationRecord | None) -> None:
        """At the end of `iteration`, feed the previous iteration's device record (collective
        while profiling: every rank calls it every iteration; None -- no record in time -- is fed
        as NaN so the all-reduce still matches). A new limit applies from `iteration + 1`."""
        optimizer = self.optimizer
        was_profiling, before = optimizer.profiling, optimizer.limit_w
        time_s = record.time_s if record is not None else math.nan
        energy = record.energy_j if record is not None and record.energy_j is not None else math.nan
        limit = optimizer.on_iteration_end(time_s, energy)
        if limit == before and not (was_profiling and not optimizer.profiling):
            return
        reason = "profiling" if optimizer.profiling else ("chosen" if was_profiling else "re-evaluated")
        self.switches.append({"iteration": iteration, "limit_w": limit, "reason": reason})
        if not optimizer.profiling and self.comm.rank == 0:
            best = {m.limit_w: m for m in optimizer.measurements}.get(limit)
            logger.info("perseus-ext: iteration %d: power limit %.0f W (%s %s, eta %g) after "
                        "profiling %d limits%s", iteration, limit, self.policy_config.type,
                        "re-evaluated" if not was_profiling else "chose", self.policy_config.eta,
                        len(optimizer.measurements),
                        f": {best.time_s:.4f} s, {best.energy_j:.1f} J per iteration (all GPUs)" if best else "")

    @property
    def chosen_at(self) -> int | None:
        """The iteration at whose end the limit was chosen (later ones ran at it)."""
        return next((s["iteration"] for s in self.switches if s["reason"] == "chosen"), None)

    def snapshot(self) -> PowerLimitSnapshot:
        optimizer = self.optimizer
        return PowerLimitSnapshot(limit_w=None if optimizer.profiling else optimizer.limit_w,
                                  profiling=optimizer.profiling,
                                  measurements=tuple(dataclasses.asdict(m) for m in optimizer.measurements),
                                  switches=tuple(self.switches), chosen_at=self.chosen_at)

    def close(self) -> None:
        self.optimizer.close()  # queues the initial limit through the controller
        self.optimizer.cost.close()
