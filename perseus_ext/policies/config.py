"""Validation of the `perseus.policy` config section (DeepSpeed key / Megatron flags) and
construction of the policy objects from it. Every error names the offending key.

Keys (documented in docs/policies.md)::

    type         "perseus" (default) | "zeus" | "chase"
    mode         "frontier" (default: pick frontier plans) | "power_limit" (Zeus' global knob)
    eta          [0, 1], default 0.5 (zeus, chase)
    max_power_w  one GPU's max power limit; default: read from the GPU by the runtime
    period_s     Chase re-evaluation period, default 300
    carbon       {"csv": path, "align": "start"|"clock"} | {"url": ..., "field": ..., "timeout_s": ...,
                 "headers": {...}} | {"callback": "module:function", "forecast_callback": ...}
                 plus optional "max_carbon" and "forecast_horizon_s"
    power_limit  {"warmup_iters": 3, "profile_iters": 5, "step_w": 25, "limits_w": [...]}
    batch_size   {"db": path, "job_id": ..., "batch_sizes": [...], "default_batch_size": ...,
                  "beta": 2.0, "pruning_rounds": 2, "seed": null}
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from perseus_ext.errors import ConfigError
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.batch_size import BatchSizeOptimizer, check_batch_sizes
from perseus_ext.policies.carbon import (
    CallbackCarbonSignal,
    CarbonSignal,
    CSVCarbonTrace,
    HTTPCarbonSignal,
)
from perseus_ext.policies.chase import CarbonCost, ChasePolicy
from perseus_ext.policies.cost import EnergyTimeCost, ZeusCost, check_eta, check_positive
from perseus_ext.policies.power_limit import (
    AllReduceSum,
    PowerLimitGPU,
    PowerLimitOptimizer,
    check_power_limit_options,
)
from perseus_ext.policies.zeus import ZeusPolicy

PREFIX = "perseus.policy"
TYPES = ("perseus", "zeus", "chase")
MODES = ("frontier", "power_limit")
DEFAULT_ETA = 0.5
DEFAULT_PERIOD_S = 300.0
TOP_KEYS = {"type", "mode", "eta", "max_power_w", "period_s", "carbon", "power_limit", "batch_size"}
CARBON_SOURCES = ("csv", "url", "callback")
CARBON_KEYS = {
    "csv": {"csv", "align"},
    "url": {"url", "field", "timeout_s", "headers"},
    "callback": {"callback", "forecast_callback"},
}
CARBON_COMMON_KEYS = {"max_carbon", "forecast_horizon_s"}
POWER_LIMIT_KEYS = {"warmup_iters", "profile_iters", "step_w", "limits_w"}
BATCH_SIZE_KEYS = {
    "db",
    "job_id",
    "batch_sizes",
    "default_batch_size",
    "beta",
    "pruning_rounds",
    "seed",
}


def _check_keys(section: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; allowed: {sorted(allowed)}"
        )


def _section(value: object, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be an object (dict), got {value!r}")
    return dict(value)


def _resolve_callable(value: object, where: str) -> Callable[..., float]:
    """A callable, or a "package.module:function" string naming one."""
    if callable(value):
        return value
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(
            f"{where} must be a callable or a 'package.module:function' string, got {value!r}"
        )
    module_name, _, attr = value.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}: cannot import {value!r} ({err})") from None
    if not callable(target):
        raise ConfigError(f"{where}: {value!r} is not callable")
    return target


@dataclass
class PolicyConfig:
    """The validated `perseus.policy` section."""

    type: str = "perseus"
    mode: str = "frontier"
    eta: float = DEFAULT_ETA
    max_power_w: float | None = None
    period_s: float = DEFAULT_PERIOD_S
    carbon: dict = field(default_factory=dict)
    power_limit: dict = field(default_factory=dict)
    batch_size: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, section: Mapping[str, Any] | None) -> "PolicyConfig":
        section = _section(section, PREFIX)
        _check_keys(section, TOP_KEYS, PREFIX)
        config = cls()
        config.type = section.get("type", "perseus")
        if config.type not in TYPES:
            raise ConfigError(f"{PREFIX}.type must be one of {list(TYPES)}, got {config.type!r}")
        config.mode = section.get("mode", "frontier")
        if config.mode not in MODES:
            raise ConfigError(f"{PREFIX}.mode must be one of {list(MODES)}, got {config.mode!r}")
        if config.mode == "power_limit" and config.type == "perseus":
            raise ConfigError(
                f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase' (a cost to minimise)"
            )
        config.eta = check_eta(section.get("eta", DEFAULT_ETA), f"{PREFIX}.eta")
        if section.get("max_power_w") is not None:
            config.max_power_w = check_positive(
                section["max_power_w"], f"{PREFIX}.max_power_w", "watts"
            )
        config.period_s = check_positive(
            section.get("period_s", DEFAULT_PERIOD_S), f"{PREFIX}.period_s", "seconds"
        )
        config.carbon = _section(section.get("carbon"), f"{PREFIX}.carbon")
        config.power_limit = _section(section.get("power_limit"), f"{PREFIX}.power_limit")
        config.batch_size = _section(section.get("batch_size"), f"{PREFIX}.batch_size")
        config._check_carbon()
        config._check_power_limit()
        config._check_batch_size()
        if config.type == "perseus" and "eta" in section and not config.batch_size:
            raise ConfigError(
                f"{PREFIX}.eta has no effect with {PREFIX}.type 'perseus' (never slows down); "
                f"set {PREFIX}.type to 'zeus' or 'chase' to trade speed for energy"
            )
        return config

    def _check_power_limit(self) -> None:
        where = f"{PREFIX}.power_limit"
        _check_keys(self.power_limit, POWER_LIMIT_KEYS, where)
        options = self.power_limit
        check_power_limit_options(
            options.get("warmup_iters", 3),
            options.get("profile_iters", 5),
            options.get("step_w", 25.0),
        )
        if "limits_w" in options:
            _float_list(options["limits_w"], f"{where}.limits_w")

    def _check_batch_size(self) -> None:
        where = f"{PREFIX}.batch_size"
        options = self.batch_size
        if not options:
            return
        _check_keys(options, BATCH_SIZE_KEYS, where)
        for key in ("db", "job_id", "batch_sizes", "default_batch_size"):
            if key not in options:
                raise ConfigError(
                    f"{where}.{key} is required to optimise the batch size across runs"
                )
        check_batch_sizes(options["batch_sizes"], options["default_batch_size"])

    def _check_carbon(self) -> None:
        where = f"{PREFIX}.carbon"
        if self.type != "chase":
            if self.carbon:
                raise ConfigError(
                    f"{where} is only used by {PREFIX}.type 'chase', not {self.type!r}"
                )
            return
        sources = [s for s in CARBON_SOURCES if s in self.carbon]
        if len(sources) != 1:
            raise ConfigError(
                f'{where} needs exactly one source: {{"csv": path}}, {{"url": "http://..."}} or '
                f'{{"callback": "module:function"}}; got keys {sorted(self.carbon)}'
            )
        _check_keys(self.carbon, CARBON_KEYS[sources[0]] | CARBON_COMMON_KEYS, where)
        if "timeout_s" in self.carbon:
            check_positive(self.carbon["timeout_s"], f"{where}.timeout_s", "seconds")

    def _max_power(self, gpu_max_power_w: float | None) -> float:
        value = self.max_power_w if self.max_power_w is not None else gpu_max_power_w
        if value is None:
            raise ConfigError(
                f"{PREFIX}.max_power_w is required for type {self.type!r} when the GPU's maximum "
                f"power limit is unknown; set it to one GPU's max power limit in watts (e.g. 400 "
                f"for an A100 SXM)"
            )
        return check_positive(value, f"{PREFIX}.max_power_w", "watts")

    def build_signal(self) -> CarbonSignal:
        where = f"{PREFIX}.carbon"
        carbon = self.carbon
        max_carbon = carbon.get("max_carbon")
        if "csv" in carbon:
            return CSVCarbonTrace(carbon["csv"], align=carbon.get("align", "start"))
        if "url" in carbon:
            headers = _section(carbon.get("headers"), f"{where}.headers")
            return HTTPCarbonSignal(
                carbon["url"],
                field=carbon.get("field", "carbonIntensity"),
                timeout_s=float(carbon.get("timeout_s", 2.0)),
                refresh_s=self.period_s,
                headers={str(k): str(v) for k, v in headers.items()},
                max_intensity=max_carbon,
            )
        forecast = carbon.get("forecast_callback")
        return CallbackCarbonSignal(
            _resolve_callable(carbon["callback"], f"{where}.callback"),
            None if forecast is None else _resolve_callable(forecast, f"{where}.forecast_callback"),
            max_intensity=max_carbon,
        )

    def build_cost(
        self, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.time
    ) -> EnergyTimeCost | None:
        """Zeus or Chase cost (None for type perseus). Chase starts its carbon signal here."""
        if self.type == "perseus":
            return None
        max_power = self._max_power(gpu_max_power_w)
        if self.type == "zeus":
            return ZeusCost(self.eta, max_power)
        return CarbonCost(
            self.eta,
            max_power,
            self.build_signal(),
            max_carbon=self.carbon.get("max_carbon"),
            period_s=self.period_s,
            forecast_horizon_s=self.carbon.get("forecast_horizon_s"),
            clock=clock,
        )

    def build_policy(
        self, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.time
    ) -> OperatingPointPolicy:
        cost = self.build_cost(gpu_max_power_w, clock)
        if cost is None:
            return StragglerPolicy()
        if isinstance(cost, CarbonCost):
            return ChasePolicy(cost)
        assert isinstance(cost, ZeusCost)
        return ZeusPolicy(cost.eta, cost.max_power_w)

    def build_power_limit_optimizer(
        self,
        gpu: PowerLimitGPU,
        *,
        cost: EnergyTimeCost | None = None,
        all_reduce: AllReduceSum | None = None,
        clock: Callable[[], float] = time.time,
    ) -> PowerLimitOptimizer:
        """`cost` lets the power-limit optimizer share a Chase policy's cost (one carbon poller);
        MaxPower defaults to the GPU's maximum power limit."""
        if cost is None:
            if self.type == "perseus":
                raise ConfigError(
                    f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase'"
                )
            gpu_max = None if self.max_power_w is not None else float(gpu.power_limit_range_w()[1])
            cost = self.build_cost(gpu_max, clock)
            assert cost is not None
        where = f"{PREFIX}.power_limit"
        options = dict(self.power_limit)
        return PowerLimitOptimizer(
            gpu,
            cost,
            warmup_iters=options.get("warmup_iters", 3),
            profile_iters=options.get("profile_iters", 5),
            step_w=options.get("step_w", 25.0),
            limits_w=(
                _float_list(options["limits_w"], f"{where}.limits_w")
                if "limits_w" in options
                else None
            ),
            all_reduce=all_reduce,
        )

    def build_batch_size_optimizer(
        self, gpu_max_power_w: float | None = None
    ) -> BatchSizeOptimizer | None:
        """None unless a `batch_size` section is configured."""
        if not self.batch_size:
            return None
        options = self.batch_size
        return BatchSizeOptimizer(
            options["db"],
            options["job_id"],
            options["batch_sizes"],
            options["default_batch_size"],
            eta=self.eta,
            max_power_w=self._max_power(gpu_max_power_w),
            beta=options.get("beta", 2.0),
            pruning_rounds=options.get("pruning_rounds", 2),
            seed=options.get("seed"),
        )


def _float_list(value: object, where: str) -> list[float]:
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ConfigError(f"{where} must be a non-empty list of watts, got {value!r}")
    return [float(v) for v in value]


def build_policy(
    section: Mapping[str, Any] | None,
    *,
    gpu_max_power_w: float | None = None,
    clock: Callable[[], float] = time.time,
) -> OperatingPointPolicy:
    """The frontier policy for a `perseus.policy` section (None = Perseus' straggler policy).

    `gpu_max_power_w` is the runtime's reading of one GPU's maximum power limit, used when the
    section has no `max_power_w`.
    """
    return PolicyConfig.parse(section).build_policy(gpu_max_power_w, clock)
