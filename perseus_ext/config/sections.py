"""The `perseus` section's own sub-sections and side inputs: the simulated workload, the
Prometheus exporter and the side file of a saved profile (`<profile_path>.json`).

Why here and not beside their users: the config door validates them before the framework builds
anything, and it must do so without importing the runtime, the exporter or the planner.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, TypeAdapter, model_validator

from perseus_ext.config.rules import (
    Rule,
    Section,
    integer,
    listing,
    number,
    require_writable,
    show,
    statement_error,
    text,
    value_error,
)
from perseus_ext.errors import ConfigError

PREFIX = "perseus"
MAX_COMPUTATION_S = 3600.0  # a simulated microbatch forward/backward longer than an hour is a typo


# ------------------------------------------------------------------------------ simulated workload
Seconds = number(example=0.02, unit="seconds", above=0, at_most=MAX_COMPUTATION_S)
_ONE_DURATION = TypeAdapter(Seconds)
_PER_STAGE_DURATIONS = TypeAdapter(listing(Seconds, what="numbers of seconds", example=[0.02, 0.03]))


def _per_stage_seconds(value: Any) -> tuple[float, ...]:
    """One duration for every stage, or one per stage."""
    if isinstance(value, (list, tuple)):
        return _PER_STAGE_DURATIONS.validate_python(value, strict=True)  # strict: true is no number
    return (_ONE_DURATION.validate_python(value, strict=True),)


PerStageSeconds = Annotated[
    tuple[float, ...],
    PlainValidator(_per_stage_seconds),
    Rule(f"a number of seconds in (0, {MAX_COMPUTATION_S:g}] or a list of them (one per stage)", 0.02),
]

# A gradient sync may take no simulated work at all (a plain module's REDUCE_GRAD only scales
# the gradients): zero is allowed, and its node then costs what the profiler measures around it.
SyncSeconds = number(example=0.002, unit="seconds", at_least=0, at_most=MAX_COMPUTATION_S)
_ONE_SYNC = TypeAdapter(SyncSeconds)
_PER_STAGE_SYNCS = TypeAdapter(listing(SyncSeconds, what="numbers of seconds", example=[0.002, 0.003]))


def _per_stage_sync_seconds(value: Any) -> tuple[float, ...]:
    """One sync duration for every stage, or one per stage."""
    if isinstance(value, (list, tuple)):
        return _PER_STAGE_SYNCS.validate_python(value, strict=True)
    return (_ONE_SYNC.validate_python(value, strict=True),)


PerStageSyncSeconds = Annotated[
    tuple[float, ...],
    PlainValidator(_per_stage_sync_seconds),
    Rule(f"a number of seconds in [0, {MAX_COMPUTATION_S:g}] or a list of them (one per stage)", 0.002),
]


class SimulatedWorkload(Section):
    """Seconds one forward/backward of one microbatch takes at the max clock, per stage.

    Only used with a simulated GPU: the runtime paces each computation to this duration at the
    current clock (the real CPU work counts towards it), so energy and time follow the GPU model
    while the training math is untouched. Split-backward schedules (zero bubble, DualPipeV) run
    input-gradient and weight-gradient computations instead of some or all backwards; their
    durations are the backward's shares by the planner's derivation rule (`planning.derived`;
    the simulator's pacer in `measurement/gpu/sim/workload.py` applies it), so one backward's
    worth of work is split, never added. A schedule that runs the gradient sync as an action
    (torch.distributed.pipelining's REDUCE_GRAD, once per model chunk) launches
    `reduce_grad_seconds` of work for it; the default 0 launches none, as for a plain module.
    """

    example: ClassVar[dict[str, Any]] = {"forward_seconds": 0.02, "backward_seconds": 0.04}

    forward_seconds: Annotated[PerStageSeconds, Field(description="one microbatch's forward at the max clock")]
    backward_seconds: Annotated[PerStageSeconds, Field(description="one microbatch's backward at the max clock")]
    reduce_grad_seconds: Annotated[PerStageSyncSeconds, Field(
        description="one model chunk's gradient sync action at the max clock (0: no work)")] = (0.0,)

    def seconds(self, stage: int, kind: str) -> float:
        """The configured seconds of a forward, backward or gradient sync (the split kinds'
        follow from the backward)."""
        tables = {"forward": self.forward_seconds, "backward": self.backward_seconds,
                  "reduce_grad": self.reduce_grad_seconds}
        if kind not in tables:
            raise ValueError(f"simulated_workload configures forward, backward and reduce_grad seconds, not {kind!r}")
        table = tables[kind]
        return table[stage] if len(table) > 1 else table[0]

    def check_stages(self, num_stages: int) -> None:
        for name in ("forward_seconds", "backward_seconds", "reduce_grad_seconds"):
            values = getattr(self, name)
            if len(values) not in (1, num_stages):
                raise ConfigError(
                    f"{PREFIX}.simulated_workload.{name} has {len(values)} entries but the "
                    f"pipeline has {num_stages} stages; give one number or one per stage"
                )



# ------------------------------------------------------------------------------ Prometheus
PROMETHEUS_PORT_ENV = "PERSEUS_PROMETHEUS_PORT"  # the base port, when the section gives none
PUSHGATEWAY_ENV = "PERSEUS_PUSHGATEWAY"  # the Pushgateway URL, when the section gives none
Port = integer(1, 65535, example=9400, what="a TCP port")


def _gateway_url(url: str) -> str:
    """A Pushgateway address: `http(s)://host[:port]` or `host:port` (prometheus-client's forms)."""
    from urllib.parse import urlsplit

    target = url if "://" in url else f"http://{url}"
    try:
        parts = urlsplit(target)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise value_error(f"{show(url)} is not a Pushgateway address; e.g. \"http://pushgateway:9091\"")
    return url


class PrometheusConfig(Section):
    """Per-rank metrics for Prometheus: an HTTP endpoint each rank serves (scraped), and/or
    pushes to a Pushgateway (short jobs that end between two scrapes)."""

    example: ClassVar[dict[str, Any]] = {"port": 9400}

    port: Annotated[Port | None, Field(
        description="base port of the /metrics endpoints: local rank r serves on port + r")] = None
    address: Annotated[text(example="127.0.0.1", what="an address to listen on"), Field(
        description="interface the endpoints listen on")] = "0.0.0.0"
    pushgateway: Annotated[
        Annotated[text(example="http://pushgateway:9091", what="a Pushgateway URL"), AfterValidator(_gateway_url)] | None,
        Field(description="Pushgateway every rank pushes to (grouped by job and rank)")] = None
    push_interval_s: Annotated[number(example=15, unit="seconds", above=0, at_most=86400), Field(
        description="seconds between pushes while training; the last push is at close")] = 15.0
    job: Annotated[text(example="gpt3-13b", what="a job name") | None, Field(
        description="the `job` label (default: the job id perseus-ext draws, the same on every rank)")] = None

    @model_validator(mode="after")
    def _somewhere_to_go(self) -> PrometheusConfig:
        if self.port is None and self.pushgateway is None and not os.environ.get(PROMETHEUS_PORT_ENV) \
                and not os.environ.get(PUSHGATEWAY_ENV):
            raise statement_error(
                f"{PREFIX}.prometheus exports nowhere: give {PREFIX}.prometheus.port (each rank serves "
                f"/metrics on port + local rank) or {PREFIX}.prometheus.pushgateway, e.g. {{\"port\": 9400}}",
                [f"{PREFIX}.prometheus.port", f"{PREFIX}.prometheus.pushgateway"],
            )
        return self


# ------------------------------------------------------------------------------ saved profiles
SIDECAR_LIMIT_BYTES = 1 << 20  # a sidecar is a few hundred bytes; anything huge is not ours


def profile_sidecar(path: str | Path) -> Path:
    """Where the blocking power measured with a saved profile is kept (the CSV has no column)."""
    return Path(f"{path}.json")


class ProfileSidecar(BaseModel):
    """`<profile_path>.json`: what the profile CSV cannot hold (profile_store.py writes it)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, frozen=True, extra="ignore")

    blocking_power_w: Annotated[float, Field(gt=0.0, le=1e5)] | None = None  # per GPU
    gpus_per_stage: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    gpu: Annotated[str, Field(max_length=256)] | None = None


def read_profile_sidecar(profile_path: str | Path, fix: str) -> ProfileSidecar | None:
    """The side file of a saved profile (None when there is none), through the bounded reader:
    at most 1 MB of UTF-8 JSON nested at most 16 deep, typed fields (finite, positive); any
    problem is one ConfigError naming perseus.profile_path, the side file, the field and `fix`."""
    from pydantic import ValidationError

    from perseus_ext.inputs import CONFIG_DEPTH, InputError, parse_json, read_text, validation_problem

    path = profile_sidecar(profile_path)
    if not path.exists():
        return None
    what = f"side file of {PREFIX}.profile_path"
    try:
        data = parse_json(read_text(path, what=what, limit_bytes=SIDECAR_LIMIT_BYTES, fix=fix), path=path, what=what,
                          fix=fix, max_depth=CONFIG_DEPTH)
        if not isinstance(data, dict):
            raise InputError(path, f"must hold a JSON object, got {type(data).__name__}", fix)
        try:
            return ProfileSidecar.model_validate(data)
        except ValidationError as err:
            field, problem = validation_problem(err)
            raise InputError(path, problem, fix, field=field) from None
    except InputError as err:
        raise ConfigError(f"{PREFIX}.profile_path {profile_path}: {err}") from None


def saved_sidecar(profile_path: str, *, need_blocking_power: bool) -> ProfileSidecar | None:
    """The side file of an existing profile, read once (here, at the door: the profile store
    takes it from the config); with `need_blocking_power` (the section sets no
    `blocking_power_w`) it must hold one. A ConfigError says how to fix either."""
    fix = (f"set {PREFIX}.blocking_power_w, or delete {profile_path} so the job profiles again" if need_blocking_power
           else f"delete {profile_path} (and {profile_sidecar(profile_path)}) to profile again")
    sidecar = read_profile_sidecar(profile_path, fix)
    if need_blocking_power and (sidecar is None or sidecar.blocking_power_w is None):
        missing = "is missing" if sidecar is None else "has no blocking_power_w"
        raise ConfigError(
            f"{PREFIX}.profile_path {profile_path} has no blocking power ({profile_sidecar(profile_path)} {missing}); "
            f"{fix}"
        )
    return sidecar


def check_profile_path(path: str) -> str:
    """An existing profile is read (must be a file; its content and `<path>.json` are checked
    against the pipeline and GPU by the runtime's profile store); a missing one is written."""
    try:
        exists, is_file = Path(path).exists(), Path(path).is_file()
    except OSError:  # e.g. no permission to look: require_writable names the problem
        exists = is_file = False
    if exists and not is_file:
        raise value_error(f"{show(path)} is not a file; give a profile CSV or a path the job may create")
    if not exists:
        require_writable(path)
    return path
