"""The `perseus.policy` config section (DeepSpeed key / Megatron flags) as a typed model, and the
policy objects built from it. Keys are documented in docs/policies.md.

Why typed and validated up front: the section is read at `deepspeed.initialize` / Megatron
`install`, while the policy runs hours later; every mistake knowable without a GPU (a bad η, a
carbon source that is not http(s), a callback that does not import, a batch size missing from
its candidates) must fail there, naming `perseus.policy.<key>`. What needs the GPU (its maximum
power limit when `max_power_w` is not given) or the network (the carbon source itself) is
checked when the runtime builds the policy.

The `carbon`, `power_limit` and `batch_size` sub-sections stay the dicts the user wrote (typed
as TypedDicts: only the keys given, defaults below), so a config round-trips unchanged.
"""

from __future__ import annotations

import importlib
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, PlainValidator, TypeAdapter, model_validator
from typing_extensions import Required, TypedDict

from perseus_ext.errors import ConfigError
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.batch_size import BatchSizeOptimizer
from perseus_ext.policies.carbon import (
    CallbackCarbonSignal,
    CarbonSignal,
    CSVCarbonTrace,
    HTTPCarbonSignal,
)
from perseus_ext.policies.chase import CarbonCost, ChasePolicy
from perseus_ext.policies.cost import EnergyTimeCost, ZeusCost
from perseus_ext.policies.power_limit import AllReduceSum, PowerLimitGPU, PowerLimitOptimizer
from perseus_ext.policies.zeus import ZeusPolicy
from perseus_ext.schema import (
    Rule,
    Section,
    StrChoice,
    choice,
    integer,
    keyed,
    listing,
    number,
    output_path,
    parse,
    show,
    statement_error,
    text,
    value_error,
)

PREFIX = "perseus.policy"
DEFAULT_ETA = 0.5
DEFAULT_PERIOD_S = 300.0
DEFAULT_URL_FIELD = "carbonIntensity"
DEFAULT_URL_TIMEOUT_S = 2.0
DEFAULT_WARMUP_ITERS = 3
DEFAULT_PROFILE_ITERS = 5
DEFAULT_STEP_W = 25.0
DEFAULT_BETA = 2.0
DEFAULT_PRUNING_ROUNDS = 2


class PolicyType(StrChoice):
    """Which cost picks the operating point (str-valued: `config.type == "zeus"` holds)."""

    PERSEUS = "perseus"
    ZEUS = "zeus"
    CHASE = "chase"


class PolicyMode(StrChoice):
    """Frontier plans, or Zeus' one global GPU power limit."""

    FRONTIER = "frontier"
    POWER_LIMIT = "power_limit"


class CarbonSourceKind(StrChoice):
    """Where Chase reads the grid's carbon intensity; the key that names the source."""

    CSV = "csv"
    URL = "url"
    CALLBACK = "callback"


class TraceAlignment(StrChoice):
    """How a CSV trace's time axis meets the job: its first row at start, or wall-clock time."""

    START = "start"
    CLOCK = "clock"


# ------------------------------------------------------------------------------ value types
Watts = number(example=400, unit="watts", above=0)
Seconds = number(example=300, unit="seconds", above=0)
GramsPerKWh = number(example=400, unit="gCO2/kWh", above=0)
_CALLABLE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _import_callable(path: str) -> Callable[..., float]:
    """The function a "package.module:function" string names, or a ConfigError saying why not
    (any failure while importing the user's module is a mistake in the config)."""
    module_name, _, attribute = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError, or the module's own error
        raise ConfigError(f"cannot import {path!r} ({type(err).__name__}: {err})") from None
    if not callable(target):
        raise ConfigError(f"{path!r} is not callable")
    return target


def resolve_callable(value: object, where: str) -> Callable[..., float]:
    """A callable, or the function a "package.module:function" string names."""
    if callable(value):
        return value
    try:
        return _import_callable(str(value))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _importable(value: Any) -> Any:
    """Imported at the door: the import is cheap and a typo should not wait for the job."""
    if not callable(value):
        try:
            _import_callable(value)
        except ConfigError as err:
            raise value_error(str(err)) from None
    return value


CallbackPath = Annotated[
    Any,
    Rule(
        "a callable or a 'package.module:function' string",
        "time:time",
        lambda v: callable(v) or (isinstance(v, str) and _CALLABLE_PATH.fullmatch(v) is not None),
    ),
    AfterValidator(_importable),
]
HttpURL = Annotated[
    str,
    Rule(
        "an http(s) URL",
        "https://api.example.org/carbon-intensity",
        lambda v: (parsed := urllib.parse.urlparse(v)).scheme in ("http", "https") and bool(parsed.netloc),
    ),
]


class _CarbonCommon(TypedDict, total=False):
    max_carbon: GramsPerKWh  # MaxCarbon; default: a CSV trace's maximum, else the highest seen
    forecast_horizon_s: Seconds  # decide on the forecast mean over this horizon


class CSVCarbonSource(_CarbonCommon, total=False):
    csv: Required[text(example="grid/caiso-2024-05.csv", what="a path to a CSV carbon trace")]
    align: choice(TraceAlignment, example="start")


class URLCarbonSource(_CarbonCommon, total=False):
    url: Required[HttpURL]
    field: Annotated[str | None, Rule("a field name (dots for nesting) or null", DEFAULT_URL_FIELD)]
    timeout_s: Seconds
    headers: Annotated[dict[str, str], Rule("an object of string headers", {"auth-token": "..."})]


class CallbackCarbonSource(_CarbonCommon, total=False):
    callback: Required[CallbackPath]
    forecast_callback: CallbackPath


CarbonSource = CSVCarbonSource | URLCarbonSource | CallbackCarbonSource
_CARBON_EXAMPLE = {"csv": "grid/caiso-2024-05.csv"}
_CARBON_ADAPTERS = {
    CarbonSourceKind.CSV: TypeAdapter(keyed(CSVCarbonSource, example=_CARBON_EXAMPLE)),
    CarbonSourceKind.URL: TypeAdapter(keyed(URLCarbonSource, example={"url": "https://api.example.org/carbon"})),
    CarbonSourceKind.CALLBACK: TypeAdapter(keyed(CallbackCarbonSource, example={"callback": "time:time"})),
}


def carbon_source_kind(carbon: Mapping[str, Any]) -> CarbonSourceKind:
    """The source a validated `carbon` sub-section names."""
    return next(kind for kind in CarbonSourceKind if kind.value in carbon)


def _one_carbon_source(data: Any) -> dict:
    """The `carbon` union resolved by which source key is present, so errors name
    `carbon.<key>` of that source (not one error per union member)."""
    if not isinstance(data, Mapping):
        raise value_error(f"must be an object, got {show(data)}; e.g. {show(_CARBON_EXAMPLE)}")
    sources = [kind for kind in CarbonSourceKind if kind.value in data]
    if len(sources) != 1:
        raise value_error(
            'needs exactly one source: {"csv": path}, {"url": "https://..."} or '
            f'{{"callback": "module:function"}}; got keys {show(sorted(map(str, data)))}'
        )
    return _CARBON_ADAPTERS[sources[0]].validate_python(data)


class PowerLimitOptions(TypedDict, total=False):
    warmup_iters: integer(0, example=DEFAULT_WARMUP_ITERS)
    profile_iters: integer(1, example=DEFAULT_PROFILE_ITERS)
    step_w: Watts
    limits_w: listing(Watts, what="positive numbers of watts", example=[300, 250, 200])


def _default_among_candidates(options: dict) -> dict:
    sizes, default = options["batch_sizes"], options["default_batch_size"]
    if default not in sizes:
        raise statement_error(
            f"{PREFIX}.batch_size.default_batch_size {default} must be one of batch_sizes "
            f"{sorted(sizes)} (it is tried first)"
        )
    return options


class BatchSizeOptions(TypedDict, total=False):
    db: Required[output_path(example="state/batch_size.db")]
    job_id: Required[text(example="gpt3-nightly")]
    batch_sizes: Required[
        listing(integer(1, example=32), what="positive integers", example=[32, 64], distinct=True)
    ]
    default_batch_size: Required[integer(1, example=32)]
    beta: number(example=DEFAULT_BETA, above=1)
    pruning_rounds: integer(1, example=DEFAULT_PRUNING_ROUNDS)
    seed: Annotated[int | None, Rule("an integer >= 0 or null", 0, lambda v: v is None or v >= 0)]


_BATCH_SIZE_EXAMPLE = {"db": "state/batch_size.db", "job_id": "gpt3-nightly", "batch_sizes": [32, 64],
                       "default_batch_size": 32}


class PolicyConfig(Section):
    """The validated `perseus.policy` section."""

    example: ClassVar[Mapping[str, Any]] = {"type": "zeus", "eta": 0.5}

    type: Annotated[choice(PolicyType, example="zeus"), Field(description="which cost picks the plan")] = (
        PolicyType.PERSEUS
    )
    mode: Annotated[
        choice(PolicyMode, example="frontier"),
        Field(description="pick frontier plans, or Zeus' global GPU power limit (needs zeus/chase)"),
    ] = PolicyMode.FRONTIER
    eta: Annotated[
        number(example=DEFAULT_ETA, at_least=0, at_most=1, out_of_range="in [0, 1]"),
        Field(description="speed/energy trade-off: 0 never slows down, 1 minimises energy only"),
    ] = DEFAULT_ETA
    max_power_w: Annotated[
        Watts | None, Field(description="one GPU's MaxPower; null: read from the GPU by the runtime")
    ] = None
    period_s: Annotated[Seconds, Field(description="Chase re-reads the carbon intensity this often")] = (
        DEFAULT_PERIOD_S
    )
    carbon: Annotated[
        Annotated[
            CarbonSource,
            PlainValidator(_one_carbon_source),
            Rule("an object with one carbon source", _CARBON_EXAMPLE),
        ]
        | None,
        Field(description="Chase's carbon-intensity source: exactly one of csv, url, callback"),
    ] = None
    power_limit: Annotated[
        Annotated[keyed(PowerLimitOptions, example={"step_w": 50}), Rule("an object", {"step_w": 50})],
        Field(description="power-limit mode's profiling knobs (all optional)"),
    ] = Field(default_factory=dict)
    batch_size: Annotated[
        Annotated[
            keyed(BatchSizeOptions, example=_BATCH_SIZE_EXAMPLE,
                  why_required=" to optimise the batch size across runs"),
            AfterValidator(_default_among_candidates),
            Rule("an object", _BATCH_SIZE_EXAMPLE),
        ]
        | None,
        Field(description="the recurring-job batch-size optimizer (Zeus)"),
    ] = None

    @model_validator(mode="after")
    def _keys_agree(self) -> PolicyConfig:
        if self.mode is PolicyMode.POWER_LIMIT and self.type is PolicyType.PERSEUS:
            raise statement_error(
                f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase' (a cost to minimise); "
                f'e.g. {{"type": "zeus", "mode": "power_limit"}}'
            )
        if self.type is PolicyType.CHASE and self.carbon is None:
            raise statement_error(
                f'{PREFIX}.carbon needs exactly one source for type \'chase\': {{"csv": path}}, '
                f'{{"url": "https://..."}} or {{"callback": "module:function"}}'
            )
        if self.type is not PolicyType.CHASE and self.carbon is not None:
            raise statement_error(
                f"{PREFIX}.carbon is only used by {PREFIX}.type 'chase', not '{self.type.value}'"
            )
        if self.type is PolicyType.PERSEUS and "eta" in self.model_fields_set and self.batch_size is None:
            raise statement_error(
                f"{PREFIX}.eta has no effect with {PREFIX}.type 'perseus' (never slows down); "
                f"set {PREFIX}.type to 'zeus' or 'chase' to trade speed for energy"
            )
        return self

    @classmethod
    def parse(cls, section: Mapping[str, Any] | PolicyConfig | None) -> PolicyConfig:
        """The validated section (None: Perseus' straggler policy); ConfigError otherwise."""
        return parse(cls, {} if section is None else section, root=PREFIX)

    @property
    def carbon_source(self) -> CarbonSourceKind | None:
        return None if self.carbon is None else carbon_source_kind(self.carbon)

    def _max_power(self, gpu_max_power_w: float | None) -> float:
        value = self.max_power_w if self.max_power_w is not None else gpu_max_power_w
        if value is None:
            raise ConfigError(
                f"{PREFIX}.max_power_w is required for type '{self.type.value}' when the GPU's maximum "
                f"power limit is unknown; set it to one GPU's max power limit in watts (e.g. 400 "
                f"for an A100 SXM)"
            )
        return value

    def build_signal(self) -> CarbonSignal:
        where = f"{PREFIX}.carbon"
        carbon: Mapping[str, Any] = self.carbon or {}
        max_carbon = carbon.get("max_carbon")
        kind = self.carbon_source
        if kind is CarbonSourceKind.CSV:
            return CSVCarbonTrace(carbon["csv"], align=carbon.get("align", TraceAlignment.START))
        if kind is CarbonSourceKind.URL:
            return HTTPCarbonSignal(
                carbon["url"],
                field=carbon.get("field", DEFAULT_URL_FIELD),
                timeout_s=carbon.get("timeout_s", DEFAULT_URL_TIMEOUT_S),
                refresh_s=self.period_s,
                headers=carbon.get("headers", {}),
                max_intensity=max_carbon,
            )
        if kind is CarbonSourceKind.CALLBACK:
            forecast = carbon.get("forecast_callback")
            return CallbackCarbonSignal(
                resolve_callable(carbon["callback"], f"{where}.callback"),
                None if forecast is None else resolve_callable(forecast, f"{where}.forecast_callback"),
                max_intensity=max_carbon,
            )
        raise ConfigError(f"{where} is required for {PREFIX}.type 'chase'")

    def build_cost(
        self, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.time
    ) -> EnergyTimeCost | None:
        """Zeus or Chase cost (None for type perseus). Chase starts its carbon signal here."""
        if self.type is PolicyType.PERSEUS:
            return None
        max_power = self._max_power(gpu_max_power_w)
        if self.type is PolicyType.ZEUS:
            return ZeusCost(self.eta, max_power)
        carbon: Mapping[str, Any] = self.carbon or {}
        return CarbonCost(
            self.eta,
            max_power,
            self.build_signal(),
            max_carbon=carbon.get("max_carbon"),
            period_s=self.period_s,
            forecast_horizon_s=carbon.get("forecast_horizon_s"),
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
            gpu_max = None if self.max_power_w is not None else float(gpu.power_limit_range_w()[1])
            cost = self.build_cost(gpu_max, clock)
            if cost is None:
                raise ConfigError(f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase'")
        options = self.power_limit
        limits_w = options.get("limits_w")
        return PowerLimitOptimizer(
            gpu,
            cost,
            warmup_iters=options.get("warmup_iters", DEFAULT_WARMUP_ITERS),
            profile_iters=options.get("profile_iters", DEFAULT_PROFILE_ITERS),
            step_w=options.get("step_w", DEFAULT_STEP_W),
            limits_w=None if limits_w is None else list(limits_w),
            all_reduce=all_reduce,
        )

    def build_batch_size_optimizer(
        self, gpu_max_power_w: float | None = None
    ) -> BatchSizeOptimizer | None:
        """None unless a `batch_size` section is configured."""
        options = self.batch_size
        if options is None:
            return None
        return BatchSizeOptimizer(
            options["db"],
            options["job_id"],
            options["batch_sizes"],
            options["default_batch_size"],
            eta=self.eta,
            max_power_w=self._max_power(gpu_max_power_w),
            beta=options.get("beta", DEFAULT_BETA),
            pruning_rounds=options.get("pruning_rounds", DEFAULT_PRUNING_ROUNDS),
            seed=options.get("seed"),
        )


def build_policy(
    section: Mapping[str, Any] | PolicyConfig | None,
    *,
    gpu_max_power_w: float | None = None,
    clock: Callable[[], float] = time.time,
) -> OperatingPointPolicy:
    """The frontier policy for a `perseus.policy` section (None = Perseus' straggler policy).

    `gpu_max_power_w` is the runtime's reading of one GPU's maximum power limit, used when the
    section has no `max_power_w`.
    """
    return PolicyConfig.parse(section).build_policy(gpu_max_power_w, clock)
