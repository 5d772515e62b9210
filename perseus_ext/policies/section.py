"""The schema of the `perseus.policy` config section (DeepSpeed key / Megatron flags): a typed
model with its defaults. Keys are documented in docs/policies.md; the policy objects built from
it come from `config.PolicyConfig`, this model plus its factories.

Why typed and validated up front: the section is read at `deepspeed.initialize` / Megatron
`install`, while the policy runs hours later; every mistake knowable without a GPU (a bad η, a
carbon source that is not http(s), a callback that does not import, a batch size missing from
its candidates) must fail there, naming `perseus.policy.<key>`. What needs the GPU (its maximum
power limit when `max_power_w` is not given) or the network (the carbon source itself) is
checked when the runtime builds the policy (config.py).

The `carbon`, `budget`, `power_limit` and `batch_size` sub-sections stay the dicts the user
wrote (typed as TypedDicts: only the keys given), so a config round-trips unchanged; the
factories (config.py) read them through frozen settings with every default applied
(`carbon_settings`, `budget_settings`, `power_limit_settings`, `batch_size_settings`),
never with `.get(key, DEFAULT)` of their own.
"""

from __future__ import annotations

import importlib
import math
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, Field, PlainValidator, TypeAdapter, model_validator
from typing_extensions import Required, TypedDict

from perseus_ext.errors import ConfigError
from perseus_ext.policies.batch_size import DEFAULT_LEASE_S
from perseus_ext.policies.bso_store import DEFAULT_NETWORK_TIMEOUT_S, StoreError, store_url
from perseus_ext.policies.carbon import DEFAULT_MAX_RESPONSE_BYTES
from perseus_ext.policies.power_budget import BudgetScope
from perseus_ext.schema import (
    Rule,
    Section,
    StrChoice,
    choice,
    flag,
    integer,
    keyed,
    listing,
    number,
    parse,
    require_writable,
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
    POWER_BUDGET = "power_budget"


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


class URLOptions(TypedDict, total=False):
    field: Annotated[str | None, Rule("a field name (dots for nesting) or null", DEFAULT_URL_FIELD)]
    timeout_s: Seconds
    headers: Annotated[dict[str, str], Rule("an object of string headers", {"auth-token": "..."})]
    max_response_bytes: integer(1, example=DEFAULT_MAX_RESPONSE_BYTES, what="a number of bytes")


class _CarbonCommon(TypedDict, total=False):
    max_carbon: GramsPerKWh  # MaxCarbon; default: a CSV trace's maximum, else the highest seen
    forecast_horizon_s: Seconds  # decide on the forecast mean over this horizon


class CSVCarbonSource(_CarbonCommon, total=False):
    csv: Required[text(example="grid/caiso-2024-05.csv", what="a path to a CSV carbon trace")]
    align: choice(TraceAlignment, example="start")


class URLCarbonSource(_CarbonCommon, URLOptions, total=False):
    url: Required[HttpURL]


class CallbackCarbonSource(_CarbonCommon, total=False):
    callback: Required[CallbackPath]
    forecast_callback: CallbackPath


class _BudgetCommon(TypedDict, total=False):
    scope: choice(BudgetScope, example="gpu")  # the average GPU's watts, or the whole job's


class FixedBudget(_BudgetCommon, total=False):
    watts: Required[Watts]


class CSVBudgetSource(_BudgetCommon, total=False):
    csv: Required[text(example="budget.csv", what="a path to a CSV budget schedule")]
    align: choice(TraceAlignment, example="start")


class URLBudgetSource(_BudgetCommon, URLOptions, total=False):
    url: Required[HttpURL]


class CallbackBudgetSource(_BudgetCommon, total=False):
    callback: Required[CallbackPath]


CarbonSource = CSVCarbonSource | URLCarbonSource | CallbackCarbonSource
BudgetSource = FixedBudget | CSVBudgetSource | URLBudgetSource | CallbackBudgetSource
_CARBON_EXAMPLE = {"csv": "grid/caiso-2024-05.csv"}
_BUDGET_EXAMPLE = {"watts": 300, "scope": "gpu"}


def carbon_source_kind(section: Mapping[str, Any]) -> CarbonSourceKind | None:
    """The signal source a validated `carbon` or `budget` sub-section names (None: fixed watts)."""
    return next((kind for kind in CarbonSourceKind if kind.value in section), None)


def _one_source(sources: Mapping[str, Any], example: Mapping[str, Any]) -> Callable[[Any], dict]:
    """A sub-section with exactly one source key, resolved by which key is present, so errors
    name `<section>.<key>` of that source (not one error per union member)."""
    adapters = {key: TypeAdapter(annotation) for key, annotation in sources.items()}
    choices = ", ".join(f'{{"{key}": ...}}' for key in sources)

    def validate(data: Any) -> dict:
        if not isinstance(data, Mapping):
            raise value_error(f"must be an object, got {show(data)}; e.g. {show(example)}")
        present = [key for key in sources if key in data]
        if len(present) != 1:
            raise value_error(
                f"needs exactly one source: {choices}; got keys {show(sorted(map(str, data)))}"
            )
        return adapters[present[0]].validate_python(data)

    return validate


_one_carbon_source = _one_source({
    "csv": keyed(CSVCarbonSource, example=_CARBON_EXAMPLE),
    "url": keyed(URLCarbonSource, example={"url": "https://api.example.org/carbon"}),
    "callback": keyed(CallbackCarbonSource, example={"callback": "time:time"}),
}, _CARBON_EXAMPLE)
_one_budget_source = _one_source({
    "watts": keyed(FixedBudget, example=_BUDGET_EXAMPLE),
    "csv": keyed(CSVBudgetSource, example={"csv": "budget.csv"}),
    "url": keyed(URLBudgetSource, example={"url": "https://facility.example.org/budget"}),
    "callback": keyed(CallbackBudgetSource, example={"callback": "mypkg.facility:budget_w"}),
}, _BUDGET_EXAMPLE)


class PowerLimitOptions(TypedDict, total=False):
    warmup_iters: integer(0, example=DEFAULT_WARMUP_ITERS)
    profile_iters: integer(1, example=DEFAULT_PROFILE_ITERS)
    step_w: Watts
    limits_w: listing(Watts, what="positive numbers of watts", example=[300, 250, 200])


def _store_location(value: str) -> str:
    """A URL the store accepts, or a path this process may create (checked at the door: a
    typo in the URL should not wait for the job)."""
    if "://" in value:
        try:
            store_url(value)
        except StoreError as err:
            raise value_error(str(err).split(": ", 1)[-1]) from None
        return value
    require_writable(str(Path(value).expanduser()), show(value))
    return value


StoreLocation = Annotated[
    str,
    Rule("a path, sqlite:///path or postgresql://user:password@host:port/db", "state/bso.db",
         lambda s: bool(s.strip())),
    AfterValidator(_store_location),
]


class TargetMetricOptions(TypedDict, total=False):
    name: Required[text(example="val_loss")]
    value: Required[Annotated[float, Rule("a finite number", 2.1, math.isfinite)]]
    higher_is_better: flag(example=False)


_TARGET_EXAMPLE = {"name": "val_loss", "value": 2.1, "higher_is_better": False}


def _batch_size_agrees(options: dict) -> dict:
    where = f"{PREFIX}.batch_size"
    locations = [key for key in ("store", "db") if key in options]
    if len(locations) != 1:
        raise statement_error(
            f"{where}.store is required (a path, sqlite:///path or postgresql://...; `db` is its "
            f"older name): give exactly one of them, got {locations or 'neither'}"
        )
    sizes, default = options["batch_sizes"], options["default_batch_size"]
    if default not in sizes:
        raise statement_error(
            f"{where}.default_batch_size {default} must be one of batch_sizes "
            f"{sorted(sizes)} (it is tried first)"
        )
    return options


class BatchSizeOptions(TypedDict, total=False):
    store: StoreLocation
    db: StoreLocation  # the key's first name, kept as an alias of `store`
    job_id: Required[text(example="gpt3-nightly")]
    batch_sizes: Required[
        listing(integer(1, example=32), what="positive integers", example=[32, 64], distinct=True)
    ]
    default_batch_size: Required[integer(1, example=32)]
    beta: number(example=DEFAULT_BETA, above=1)
    pruning_rounds: integer(1, example=DEFAULT_PRUNING_ROUNDS)
    seed: Annotated[int | None, Rule("an integer >= 0 or null", 0, lambda v: v is None or v >= 0)]
    lease_s: Seconds
    timeout_s: Seconds  # a PostgreSQL store's connect timeout (default 5 s)
    target_metric: keyed(TargetMetricOptions, example=_TARGET_EXAMPLE)


_BATCH_SIZE_EXAMPLE = {"store": "state/bso.db", "job_id": "gpt3-nightly", "batch_sizes": [32, 64],
                       "default_batch_size": 32}


@dataclass(frozen=True)
class SignalSourceSettings:
    """One signal source of `carbon` or `budget` (exactly one of csv, url, callback) with its
    defaults applied: what the carbon or budget signal is built with."""

    kind: CarbonSourceKind
    location: str  # the CSV path, the URL or the callback's import path
    align: TraceAlignment = TraceAlignment.START  # csv
    field: str | None = None  # url: the default depends on the quantity (carbon: DEFAULT_URL_FIELD)
    timeout_s: float = DEFAULT_URL_TIMEOUT_S  # url
    headers: tuple[tuple[str, str], ...] = ()  # url
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES  # url
    forecast_callback: str | None = None  # callback

    @classmethod
    def of(cls, section: Mapping[str, Any], default_field: str | None) -> SignalSourceSettings | None:
        """The source a validated `carbon` or `budget` sub-section names; None for fixed watts."""
        kind = carbon_source_kind(section)
        if kind is None:
            return None
        given = {key: section[key] for key in ("align", "timeout_s", "max_response_bytes", "forecast_callback")
                 if key in section}
        return cls(kind, section[kind.value], field=section.get("field", default_field),
                   headers=tuple(section.get("headers", {}).items()), **given)


@dataclass(frozen=True)
class CarbonSettings:
    """`carbon` with its defaults applied: what Chase's cost and its signal are built with."""

    source: SignalSourceSettings
    max_carbon: float | None = None  # None: a CSV trace's maximum, else the highest seen
    forecast_horizon_s: float | None = None  # None: decide on the current intensity


@dataclass(frozen=True)
class BudgetSettings:
    """`budget` with its defaults applied: fixed watts or a signal source, and its scope."""

    watts: float | None  # None: read from `source`
    source: SignalSourceSettings | None
    scope: BudgetScope = BudgetScope.GPU


@dataclass(frozen=True)
class PowerLimitSettings:
    """`power_limit` with its defaults applied: what the power-limit optimizer is built with."""

    warmup_iters: int = DEFAULT_WARMUP_ITERS
    profile_iters: int = DEFAULT_PROFILE_ITERS
    step_w: float = DEFAULT_STEP_W
    limits_w: tuple[float, ...] | None = None  # None: from the max limit down by step_w


@dataclass(frozen=True)
class BatchSizeSettings:
    """`batch_size` with its defaults applied (`db` read as `store`): what the batch-size
    optimizer and the recurring job are built with."""

    store: str
    job_id: str
    batch_sizes: tuple[int, ...]
    default_batch_size: int
    beta: float = DEFAULT_BETA
    pruning_rounds: int = DEFAULT_PRUNING_ROUNDS
    seed: int | None = None
    lease_s: float = DEFAULT_LEASE_S
    network_timeout_s: float = DEFAULT_NETWORK_TIMEOUT_S


class PolicySection(Section):
    """The validated `perseus.policy` section: the schema, typed with its defaults (what it builds:
    `config.PolicyConfig`)."""

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
    budget: Annotated[
        Annotated[BudgetSource, PlainValidator(_one_budget_source), Rule("an object with one budget source", _BUDGET_EXAMPLE)]
        | None,
        Field(description="power_budget's budget: watts, or one of csv, url, callback; scope gpu or job"),
    ] = None
    power_limit: Annotated[
        Annotated[keyed(PowerLimitOptions, example={"step_w": 50}), Rule("an object", {"step_w": 50})],
        Field(description="power-limit mode's profiling knobs (all optional)"),
    ] = Field(default_factory=dict)
    batch_size: Annotated[
        Annotated[
            keyed(BatchSizeOptions, example=_BATCH_SIZE_EXAMPLE,
                  why_required=" to optimise the batch size across runs"),
            AfterValidator(_batch_size_agrees),
            Rule("an object", _BATCH_SIZE_EXAMPLE),
        ]
        | None,
        Field(description="the recurring-job batch-size optimizer (Zeus)"),
    ] = None

    @model_validator(mode="after")
    def _keys_agree(self) -> PolicySection:
        if self.mode is PolicyMode.POWER_LIMIT and self.type not in (PolicyType.ZEUS, PolicyType.CHASE):
            raise statement_error(
                f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase' (a cost to minimise); "
                f'e.g. {{"type": "zeus", "mode": "power_limit"}}'
            )
        for key, owner in (("carbon", PolicyType.CHASE), ("budget", PolicyType.POWER_BUDGET)):
            given = getattr(self, key) is not None
            if self.type is owner and not given:
                example = _CARBON_EXAMPLE if key == "carbon" else _BUDGET_EXAMPLE
                raise statement_error(
                    f"{PREFIX}.{key} needs exactly one source for type '{owner.value}', "
                    f"e.g. {show(example)}"
                )
            if self.type is not owner and given:
                raise statement_error(
                    f"{PREFIX}.{key} is only used by {PREFIX}.type '{owner.value}', not '{self.type.value}'"
                )
        if self.type is PolicyType.PERSEUS and "eta" in self.model_fields_set and self.batch_size is None:
            raise statement_error(
                f"{PREFIX}.eta has no effect with {PREFIX}.type 'perseus' (never slows down); "
                f"set {PREFIX}.type to 'zeus' or 'chase' to trade speed for energy"
            )
        return self

    @classmethod
    def parse(cls, section: Mapping[str, Any] | Section | None) -> Self:
        """The validated section (None: Perseus' straggler policy); ConfigError otherwise."""
        return parse(cls, {} if section is None else section, root=PREFIX)

    @property
    def carbon_source(self) -> CarbonSourceKind | None:
        return None if self.carbon is None else carbon_source_kind(self.carbon)

    @property
    def carbon_settings(self) -> CarbonSettings | None:
        """The `carbon` section with every default applied; None without one."""
        if self.carbon is None:
            return None
        source = SignalSourceSettings.of(self.carbon, DEFAULT_URL_FIELD)
        assert source is not None  # the schema requires exactly one source
        return CarbonSettings(source, self.carbon.get("max_carbon"), self.carbon.get("forecast_horizon_s"))

    @property
    def budget_settings(self) -> BudgetSettings | None:
        """The `budget` section with every default applied; None without one."""
        if self.budget is None:
            return None
        return BudgetSettings(self.budget.get("watts"), SignalSourceSettings.of(self.budget, None),
                              BudgetScope(self.budget.get("scope", BudgetScope.GPU)))

    @property
    def power_limit_settings(self) -> PowerLimitSettings:
        """The `power_limit` section (the keys given) with every default applied."""
        options = dict(self.power_limit)
        if options.get("limits_w") is not None:
            options["limits_w"] = tuple(options["limits_w"])
        return PowerLimitSettings(**options)

    @property
    def batch_size_settings(self) -> BatchSizeSettings | None:
        """The `batch_size` section with every default applied; None without one."""
        options = self.batch_size
        if options is None:
            return None
        return BatchSizeSettings(
            store=options.get("store", options.get("db")), job_id=options["job_id"],
            batch_sizes=tuple(options["batch_sizes"]), default_batch_size=options["default_batch_size"],
            **{key: options[key] for key in ("beta", "pruning_rounds", "seed", "lease_s") if key in options},
            **({"network_timeout_s": options["timeout_s"]} if "timeout_s" in options else {}))
