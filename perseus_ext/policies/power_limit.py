"""Zeus' global power-limit mode: profile GPU power limits just in time during the first
iterations, then keep the limit minimising the energy–time cost.

This is the knob for jobs without pipeline parallelism (no frontier to pick from) and the
comparison point for Perseus. It is driven by the runtime once per iteration and stays free of
torch: cross-rank aggregation is an injected callable.
"""

from __future__ import annotations

import atexit
import logging
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from perseus_ext.policies.cost import CostWeights, EnergyTimeCost, check_positive
from perseus_ext.errors import ConfigError

logger = logging.getLogger(__name__)

#: Sums a list of floats over all data-parallel ranks, e.g. for torch.distributed:
#: ``t = torch.tensor(v, dtype=torch.float64, device=dev); dist.all_reduce(t); return t.tolist()``
AllReduceSum = Callable[[Sequence[float]], Sequence[float]]


class PowerLimitGPU(Protocol):
    """The part of the device layer's GPU API this optimizer uses."""

    def power_limit_range_w(self) -> tuple[float, float]: ...

    def set_power_limit_w(self, watts: float) -> None: ...

    def reset_power_limit(self) -> None: ...


@dataclass(frozen=True)
class LimitMeasurement:
    """Per-iteration averages at one power limit, aggregated over every rank."""

    limit_w: float
    time_s: float  # mean iteration time over ranks
    energy_j: float  # energy of one iteration summed over ranks
    num_gpus: int

    def cost(self, weights: CostWeights) -> float:
        return weights.cost(self.time_s, self.energy_j, self.num_gpus)


def candidate_limits(min_w: float, max_w: float, step_w: float) -> list[float]:
    """Max down to min in `step_w` steps (the max limit first: profiling starts at full speed)."""
    count = int(math.floor((max_w - min_w) / step_w + 1e-9)) + 1
    return [max_w - k * step_w for k in range(count)]


def check_power_limit_options(warmup_iters: object, profile_iters: object, step_w: object) -> float:
    """Validate the profiling knobs (ConfigError naming the key); returns `step_w` as a float."""
    where = "perseus.policy.power_limit"
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
        raise ConfigError(f"{where}.warmup_iters must be an integer >= 0, got {warmup_iters!r}")
    if isinstance(profile_iters, bool) or not isinstance(profile_iters, int) or profile_iters < 1:
        raise ConfigError(f"{where}.profile_iters must be an integer >= 1, got {profile_iters!r}")
    return check_positive(step_w, f"{where}.step_w", "watts")


class PowerLimitOptimizer:
    """Per iteration: `warmup_iters` discarded after each limit change (the GPU settles), then
    `profile_iters` measured; after the last candidate, the cost-optimal limit is kept. With a
    time-varying cost (Chase) the choice is re-evaluated from the stored measurements whenever
    the cost's weights change. Every rank must call `on_iteration_end` once per iteration (the
    all-reduce is collective). GPU failures are logged and never raised; `close()` (also run at
    interpreter exit) restores the default limit.
    """

    def __init__(
        self,
        gpu: PowerLimitGPU,
        cost: EnergyTimeCost,
        *,
        warmup_iters: int = 3,
        profile_iters: int = 5,
        step_w: float = 25.0,
        limits_w: Sequence[float] | None = None,
        all_reduce: AllReduceSum | None = None,
    ):
        step_w = check_power_limit_options(warmup_iters, profile_iters, step_w)
        self.gpu = gpu
        self.cost = cost
        self.warmup_iters = warmup_iters
        self.profile_iters = profile_iters
        self.all_reduce = all_reduce
        self.measurements: list[LimitMeasurement] = []
        self.limit_w: float | None = None
        self.profiling = True
        self._closed = False
        self._queue: list[float] = []
        self._skip = 0
        self._times: list[float] = []
        self._energies: list[float] = []
        self._weights: CostWeights | None = None
        try:
            low, high = (float(w) for w in gpu.power_limit_range_w())
        except Exception as err:
            logger.warning(
                "cannot read the GPU power-limit range (%s); power-limit mode disabled", err
            )
            self.profiling = False
            return
        if limits_w is None:
            self._queue = candidate_limits(low, high, step_w)
        else:
            bad = [w for w in limits_w if not low <= w <= high]
            if bad or not limits_w:
                raise ConfigError(
                    f"perseus.policy.power_limit.limits_w must be a non-empty list within the GPU's "
                    f"range [{low:g}, {high:g}] W, got {list(limits_w)}"
                )
            self._queue = sorted((float(w) for w in limits_w), reverse=True)
        atexit.register(self.close)
        self._start_next_limit()

    def _set_limit(self, watts: float) -> bool:
        try:
            self.gpu.set_power_limit_w(watts)
        except Exception as err:  # a failing GPU call never kills training
            logger.warning("setting power limit %.0f W failed (%s); skipping it", watts, err)
            return False
        self.limit_w = watts
        return True

    def _start_next_limit(self) -> None:
        """Move to the next candidate that can be set; finish profiling when none is left."""
        while self._queue:
            if self._set_limit(self._queue.pop(0)):
                self._skip = self.warmup_iters
                self._times.clear()
                self._energies.clear()
                return
        self.profiling = False
        if self.measurements:
            logger.info(
                "power-limit profile: %s",
                ", ".join(
                    f"{m.limit_w:.0f} W: {m.time_s:.3f} s {m.energy_j:.0f} J"
                    for m in self.measurements
                ),
            )
        self._deploy_best()

    def _record(self) -> None:
        local = [
            sum(self._times) / len(self._times),
            sum(self._energies) / len(self._energies),
            1.0,
        ]
        total = list(self.all_reduce(local)) if self.all_reduce is not None else local
        num_gpus = int(round(total[2]))
        assert self.limit_w is not None
        self.measurements.append(
            LimitMeasurement(self.limit_w, total[0] / num_gpus, total[1], num_gpus)
        )

    def best(self, weights: CostWeights) -> LimitMeasurement:
        """The measured limit of least cost; ties go to the higher (faster) limit."""
        return min(self.measurements, key=lambda m: (m.cost(weights), -m.limit_w))

    def _deploy_best(self) -> None:
        weights = self.cost.weights()
        self._weights = weights
        if not self.measurements:
            return
        if weights is None:  # no cost yet (no carbon reading): never slow down on missing info
            target = max(m.limit_w for m in self.measurements)
        else:
            target = self.best(weights).limit_w
        if target != self.limit_w:
            logger.info("deploying power limit %.0f W", target)
            self._set_limit(target)

    def on_iteration_end(self, iteration_time_s: float, energy_j: float) -> float | None:
        """Feed one iteration's wall time and this GPU's energy; returns the limit now in effect."""
        if self._closed:
            return self.limit_w
        if not self.profiling:
            if self.measurements and self.cost.weights() != self._weights:
                self._deploy_best()
            return self.limit_w
        if self._skip > 0:
            self._skip -= 1
            return self.limit_w
        self._times.append(float(iteration_time_s))
        self._energies.append(float(energy_j))
        if len(self._times) >= self.profile_iters:
            self._record()
            self._start_next_limit()
        return self.limit_w

    def close(self) -> None:
        """Restore the GPU's default power limit; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.gpu.reset_power_limit()
        except Exception as err:
            logger.warning("restoring the default power limit failed: %s", err)

    def __enter__(self) -> "PowerLimitOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
