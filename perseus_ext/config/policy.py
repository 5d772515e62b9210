"""The `perseus.policy` section (DeepSpeed key / Megatron flags): one frozen model per
sub-section, every default written once, here. Keys are documented in docs/policies.md; the
policy objects built from a section come from `perseus_ext.policies.factories`.

Why typed and validated up front: the section is read at `deepspeed.initialize` / Megatron
`install`, while the policy runs hours later; every mistake knowable without a GPU (a bad η, a
carbon source that is not http(s), a callback that does not import, a batch size missing from
its candidates, a store URL of an unsupported database) must fail there, naming
`perseus.policy.<key>`. What needs the GPU (its maximum power limit when `max_power_w` is not
given) or the network (the carbon source, the store's server) is checked when the runtime builds
the policy.
"""

from __future__ import annotations

import importlib
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, Field, PlainSerializer, PlainValidator, SerializationInfo, model_validator

from perseus_ext.config.rules import (
    Rule,
    Section,
    StrChoice,
    choice,
    flag,
    integer,
    listing,
    number,
    parse,
    require_writable,
    show,
    statement_error,
    text,
    value_error,
)
from perseus_ext.errors import ConfigError

PREFIX = "perseus.policy"
DEFAULT_ETA = 0.5
DEFAULT_PERIOD_S = 300.0
DEFAULT_URL_FIELD = "carbonIntensity"
DEFAULT_URL_TIMEOUT_S = 2.0
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20  # an HTTP signal's answer larger than this is refused
DEFAULT_WARMUP_ITERS = 3
DEFAULT_PROFILE_ITERS = 5
DEFAULT_STEP_W = 25.0
DEFAULT_BETA = 2.0
DEFAULT_PRUNING_ROUNDS = 2
DEFAULT_LEASE_S = 600.0  # a run that has sent no heartbeat for this long is taken for crashed
# A PostgreSQL store's connect timeout (the whole start-up: a server that accepts and never
# answers fails in this long, not in minutes) and how long sent data may stay unacknowledged
# (a host gone mid-transaction). Not a statement timeout: writers wait for each other's row
# locks, which takes as long as it takes.
DEFAULT_NETWORK_TIMEOUT_S = 5.0
MAX_STORE_LOCATION_CHARS = 4096  # PATH_MAX


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
    """Where a signal (carbon intensity, power budget) is read; the key that names the source."""

    CSV = "csv"
    URL = "url"
    CALLBACK = "callback"


class TraceAlignment(StrChoice):
    """How a CSV trace's time axis meets the job: its first row at start, or wall-clock time."""

    START = "start"
    CLOCK = "clock"


class BudgetScope(StrChoice):
    """What a budget in watts covers."""

    GPU = "gpu"  # the average GPU of the job
    JOB = "job"  # all of the job's GPUs together


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
Headers = Annotated[dict[str, str], Rule("an object of string headers", {"auth-token": "..."})]


# ------------------------------------------------------------------------------ signal sources
class _SignalSource(Section):
    """One source of a signal; `kind` says which key names it."""

    kind: ClassVar[CarbonSourceKind]

    @property
    def location(self) -> str:
        """The CSV path, the URL or the callback's import path (or the callable itself)."""
        return getattr(self, self.kind.value)


class _CSVSource(_SignalSource):
    kind: ClassVar[CarbonSourceKind] = CarbonSourceKind.CSV
    align: choice(TraceAlignment, example="start") = TraceAlignment.START


class _URLSource(_SignalSource):
    kind: ClassVar[CarbonSourceKind] = CarbonSourceKind.URL
    url: HttpURL
    timeout_s: Seconds = DEFAULT_URL_TIMEOUT_S
    headers: Headers = Field(default_factory=dict)
    max_response_bytes: integer(1, example=DEFAULT_MAX_RESPONSE_BYTES, what="a number of bytes") = (
        DEFAULT_MAX_RESPONSE_BYTES)


class _CallbackSource(_SignalSource):
    kind: ClassVar[CarbonSourceKind] = CarbonSourceKind.CALLBACK
    callback: CallbackPath


FieldPath = Annotated[str | None, Rule("a field name (dots for nesting) or null", DEFAULT_URL_FIELD)]


class _CarbonCommon(Section):
    max_carbon: GramsPerKWh | None = None  # MaxCarbon; None: a CSV trace's maximum, else the highest seen
    forecast_horizon_s: Seconds | None = None  # decide on the forecast mean over this horizon; None: now


class CSVCarbonSource(_CSVSource, _CarbonCommon):
    example: ClassVar[Mapping[str, Any]] = {"csv": "grid/caiso-2024-05.csv"}
    csv: text(example="grid/caiso-2024-05.csv", what="a path to a CSV carbon trace")


class URLCarbonSource(_URLSource, _CarbonCommon):
    example: ClassVar[Mapping[str, Any]] = {"url": "https://api.example.org/carbon"}
    field: FieldPath = DEFAULT_URL_FIELD


class CallbackCarbonSource(_CallbackSource, _CarbonCommon):
    example: ClassVar[Mapping[str, Any]] = {"callback": "time:time"}
    forecast_callback: CallbackPath | None = None


class _BudgetCommon(Section):
    scope: choice(BudgetScope, example="gpu") = BudgetScope.GPU  # the average GPU's watts, or the whole job's


class FixedBudget(_BudgetCommon):
    example: ClassVar[Mapping[str, Any]] = {"watts": 300, "scope": "gpu"}
    watts: Watts


class CSVBudgetSource(_CSVSource, _BudgetCommon):
    example: ClassVar[Mapping[str, Any]] = {"csv": "budget.csv"}
    csv: text(example="budget.csv", what="a path to a CSV budget schedule")


class URLBudgetSource(_URLSource, _BudgetCommon):
    example: ClassVar[Mapping[str, Any]] = {"url": "https://facility.example.org/budget"}
    field: FieldPath = None  # a budget has no conventional field name


class CallbackBudgetSource(_CallbackSource, _BudgetCommon):
    example: ClassVar[Mapping[str, Any]] = {"callback": "mypkg.facility:budget_w"}


CarbonSource = CSVCarbonSource | URLCarbonSource | CallbackCarbonSource
BudgetSource = FixedBudget | CSVBudgetSource | URLBudgetSource | CallbackBudgetSource
_CARBON_EXAMPLE = CSVCarbonSource.example
_BUDGET_EXAMPLE = FixedBudget.example


def _dump(model: Section, info: SerializationInfo) -> dict[str, Any]:
    """A source as its own model dumps it (the field's type is a union picked by key)."""
    return model.model_dump(mode=info.mode)


def _one_source(sources: Mapping[str, type[Section]], example: Mapping[str, Any]) -> Callable[[Any], Section]:
    """A sub-section with exactly one source key, resolved by which key is present, so errors
    name `<section>.<key>` of that source (not one error per union member)."""
    models = tuple(sources.values())
    choices = ", ".join(f'{{"{key}": ...}}' for key in sources)

    def validate(data: Any) -> Section:
        if isinstance(data, models):
            return data
        if not isinstance(data, Mapping):
            raise value_error(f"must be an object, got {show(data)}; e.g. {show(example)}")
        present = [key for key in sources if key in data]
        if len(present) != 1:
            raise value_error(f"needs exactly one source: {choices}; got keys {show(sorted(map(str, data)))}")
        return sources[present[0]].model_validate(data)

    return validate


_one_carbon_source = _one_source(
    {"csv": CSVCarbonSource, "url": URLCarbonSource, "callback": CallbackCarbonSource}, _CARBON_EXAMPLE)
_one_budget_source = _one_source(
    {"watts": FixedBudget, "csv": CSVBudgetSource, "url": URLBudgetSource, "callback": CallbackBudgetSource},
    _BUDGET_EXAMPLE)


# ------------------------------------------------------------------------------ power-limit mode
class PowerLimitOptions(Section):
    """Zeus' power-limit mode: how each limit is profiled (all optional)."""

    example: ClassVar[Mapping[str, Any]] = {"step_w": 50}
    warmup_iters: integer(0, example=DEFAULT_WARMUP_ITERS) = DEFAULT_WARMUP_ITERS
    profile_iters: integer(1, example=DEFAULT_PROFILE_ITERS) = DEFAULT_PROFILE_ITERS
    step_w: Watts = DEFAULT_STEP_W
    limits_w: listing(Watts, what="positive numbers of watts", example=[300, 250, 200]) | None = None  # None:
    # from the GPU's max limit down by step_w


# ------------------------------------------------------------------------------ batch size
_STORE_FORMS = "use a path, sqlite:///path or postgresql://user:password@host:port/db"


def store_url_problem(location: str) -> str | None:
    """What is wrong with a store URL (None: nothing the door can tell; the store checks the
    server when it connects). Plain URL syntax, so validating a config needs no database driver."""
    if "\0" in location or len(location) > MAX_STORE_LOCATION_CHARS:
        return (f"{location[:60]!r}{'...' * (len(location) > 60)} is not a path or URL (a NUL byte, or longer than "
                f"{MAX_STORE_LOCATION_CHARS} characters)")
    try:
        parts = urllib.parse.urlsplit(location)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return f"{location!r} is not a URL; {_STORE_FORMS}"
    database = parts.scheme.partition("+")[0]
    if database == "sqlite":
        rest = location.partition("://")[2]
        name = rest.partition("/")[2]
        if not name or name == ":memory:":
            return (f"{location!r} names no file; an in-memory SQLite store would forget every run, use "
                    f"sqlite:///path/to/bso.db")
        return None
    if database in ("postgresql", "postgres"):
        return None
    return f"unsupported database {database!r} in {location!r}; {_STORE_FORMS}"


def _store_location(value: str) -> str:
    """A URL the store accepts, or a path this process may create (checked at the door: a
    typo in the URL should not wait for the job)."""
    if "://" in value:
        problem = store_url_problem(value)
        if problem is not None:
            raise value_error(problem)
        return value
    require_writable(str(Path(value).expanduser()), show(value))
    return value


StoreLocation = Annotated[
    str,
    Rule("a path, sqlite:///path or postgresql://user:password@host:port/db", "state/bso.db",
         lambda s: bool(s.strip())),
    AfterValidator(_store_location),
]


class TargetMetricOptions(Section):
    """The job's target: `name` reaching `value` (from above if lower is better)."""

    example: ClassVar[Mapping[str, Any]] = {"name": "val_loss", "value": 2.1, "higher_is_better": False}
    name: text(example="val_loss")
    value: Annotated[float, Rule("a finite number", 2.1, math.isfinite)]
    higher_is_better: flag(example=False) = True


class BatchSizeOptions(Section):
    """The recurring-job batch-size optimizer (Zeus): the store, the candidates, the search."""

    example: ClassVar[Mapping[str, Any]] = {"store": "state/bso.db", "job_id": "gpt3-nightly",
                                            "batch_sizes": [32, 64], "default_batch_size": 32}
    store: StoreLocation | None = None  # exactly one of store and db (its first name) is given
    db: StoreLocation | None = None
    job_id: text(example="gpt3-nightly")
    batch_sizes: listing(integer(1, example=32), what="positive integers", example=[32, 64], distinct=True)
    default_batch_size: integer(1, example=32)
    beta: number(example=DEFAULT_BETA, above=1) = DEFAULT_BETA
    pruning_rounds: integer(1, example=DEFAULT_PRUNING_ROUNDS) = DEFAULT_PRUNING_ROUNDS
    seed: Annotated[int | None, Rule("an integer >= 0 or null", 0, lambda v: v is None or v >= 0)] = None
    lease_s: Seconds = DEFAULT_LEASE_S
    timeout_s: Seconds = DEFAULT_NETWORK_TIMEOUT_S  # a PostgreSQL store's connect timeout
    target_metric: Annotated[TargetMetricOptions, Rule("an object", TargetMetricOptions.example)] | None = None
    why_required: ClassVar[str] = " to optimise the batch size across runs"

    @model_validator(mode="after")
    def _keys_agree(self) -> Self:
        where = f"{PREFIX}.batch_size"
        locations = [key for key in ("store", "db") if getattr(self, key) is not None]
        if len(locations) != 1:
            raise statement_error(
                f"{where}.store is required (a path, sqlite:///path or postgresql://...; `db` is its "
                f"older name): give exactly one of them, got {locations or 'neither'}",
                [f"{where}.{key}" for key in locations or ["store"]],
            )
        if self.default_batch_size not in self.batch_sizes:
            raise statement_error(
                f"{where}.default_batch_size {self.default_batch_size} must be one of batch_sizes "
                f"{sorted(self.batch_sizes)} (it is tried first)",
                [f"{where}.default_batch_size", f"{where}.batch_sizes"],
            )
        return self

    @property
    def location(self) -> str:
        """The store (`store`, or `db`, its first name)."""
        return self.store if self.store is not None else self.db  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the section
class PolicySection(Section):
    """The validated `perseus.policy` section (what it builds: `perseus_ext.policies.factories`)."""

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
        Annotated[CarbonSource, PlainValidator(_one_carbon_source), PlainSerializer(_dump),
                  Rule("an object with one carbon source", _CARBON_EXAMPLE)] | None,
        Field(description="Chase's carbon-intensity source: exactly one of csv, url, callback"),
    ] = None
    budget: Annotated[
        Annotated[BudgetSource, PlainValidator(_one_budget_source), PlainSerializer(_dump),
                  Rule("an object with one budget source", _BUDGET_EXAMPLE)] | None,
        Field(description="power_budget's budget: watts, or one of csv, url, callback; scope gpu or job"),
    ] = None
    power_limit: Annotated[
        Annotated[PowerLimitOptions, Rule("an object", PowerLimitOptions.example)],
        Field(description="power-limit mode's profiling knobs (all optional)"),
    ] = PowerLimitOptions()
    batch_size: Annotated[
        Annotated[BatchSizeOptions, Rule("an object", BatchSizeOptions.example)] | None,
        Field(description="the recurring-job batch-size optimizer (Zeus)"),
    ] = None

    @model_validator(mode="after")
    def _keys_agree(self) -> Self:
        if self.mode is PolicyMode.POWER_LIMIT and self.type not in (PolicyType.ZEUS, PolicyType.CHASE):
            raise statement_error(
                f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase' (a cost to minimise); "
                f'e.g. {{"type": "zeus", "mode": "power_limit"}}',
                [f"{PREFIX}.mode", f"{PREFIX}.type"],
            )
        for key, owner in (("carbon", PolicyType.CHASE), ("budget", PolicyType.POWER_BUDGET)):
            given = getattr(self, key) is not None
            if self.type is owner and not given:
                example = _CARBON_EXAMPLE if key == "carbon" else _BUDGET_EXAMPLE
                raise statement_error(
                    f"{PREFIX}.{key} needs exactly one source for type '{owner.value}', e.g. {show(example)}",
                    [f"{PREFIX}.{key}", f"{PREFIX}.type"],
                )
            if self.type is not owner and given:
                raise statement_error(
                    f"{PREFIX}.{key} is only used by {PREFIX}.type '{owner.value}', not '{self.type.value}'",
                    [f"{PREFIX}.{key}", f"{PREFIX}.type"],
                )
        if self.type is PolicyType.PERSEUS and "eta" in self.model_fields_set and self.batch_size is None:
            raise statement_error(
                f"{PREFIX}.eta has no effect with {PREFIX}.type 'perseus' (never slows down); "
                f"set {PREFIX}.type to 'zeus' or 'chase' to trade speed for energy",
                [f"{PREFIX}.eta", f"{PREFIX}.type"],
            )
        return self

    @classmethod
    def parse(cls, section: Mapping[str, Any] | Section | None) -> Self:
        """The validated section (None: Perseus' straggler policy); ConfigError otherwise."""
        return parse(cls, {} if section is None else section, root=PREFIX)

    @property
    def carbon_source(self) -> CarbonSourceKind | None:
        return None if self.carbon is None else self.carbon.kind
