"""The `"perseus"` configuration section: one typed model, validated completely at the door.

Why: the section arrives inside a framework config (a DeepSpeed JSON file, Megatron flags), so
every mistake knowable without a GPU must fail at `deepspeed.initialize` / Megatron `install`
with a message naming `perseus.<key>` (nested: `perseus.policy.eta`,
`perseus.solver.min_grid_points`) and the fix, not hours later inside a training step. The
`policy` and `solver` sub-sections come out typed (`PolicyConfig`, `SolverOptions`), output
paths are checked to be writable, and a saved profile's blocking power is read here. What needs
the GPU or the pipeline (are the candidate clocks supported? which clock is "min"? does a saved
profile fit this pipeline and GPU?) is the runtime's.

The same model generates the Megatron `--perseus-<key>` flags
(`perseus_ext.adapters.megatron_args`) and the key table of README.md and docs/deepspeed.md
(`key_table_markdown`). This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr, TypeAdapter, model_validator

from perseus_ext.errors import ConfigError, SolverError
from perseus_ext.measurement.gpu import ENV_SPEC as GPU_ENV
from perseus_ext.measurement.gpu import check_gpu_spec
from perseus_ext.planning.options import BOUNDS as SOLVER_OPTION_BOUNDS
from perseus_ext.planning.options import SolverOptions
from perseus_ext.policies.config import PolicyConfig
from perseus_ext.schema import (
    Rule,
    Section,
    StrChoice,
    choice,
    dataclass_section,
    field_rule,
    flag,
    integer,
    listing,
    number,
    output_path,
    parse,
    rank_template,
    require_writable,
    show,
    statement_error,
    text,
    value_error,
)


PREFIX = "perseus"
CONTROL_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)  # a second .. a week
MAX_COMPUTATION_S = 3600.0  # a simulated microbatch forward/backward longer than an hour is a typo


class Mode(StrChoice):
    """`optimize` plans and sets clocks; `observe` only measures (the baseline)."""

    OPTIMIZE = "optimize"
    OBSERVE = "observe"


# ------------------------------------------------------------------------------ solver options
def _solver_bounds() -> dict[str, Any]:
    """Door rules of every `SolverOptions` field, from the solver's own bounds (one table:
    `perseus_ext.planning.options.BOUNDS`): beyond them its grid or LP count (and its memory)
    explodes or the option is meaningless (e.g. a negative grid)."""
    rules: dict[str, Any] = {}
    for option in dataclasses.fields(SolverOptions):
        default = option.default
        if isinstance(default, bool):
            rules[option.name] = flag(example=default)
            continue
        low, high = SOLVER_OPTION_BOUNDS[option.name]
        if isinstance(default, int):
            rules[option.name] = integer(int(low), int(high), example=default)
        else:
            rules[option.name] = number(example=default, at_least=low, at_most=high)
    return rules


SOLVER_BOUNDS: dict[str, Any] = _solver_bounds()

_SOLVER_EXAMPLE = {"min_grid_points": 300}


# ------------------------------------------------------------------------------ simulated workload
Seconds = number(example=0.02, unit="seconds", above=0, at_most=MAX_COMPUTATION_S)
_ONE_DURATION = TypeAdapter(Seconds)
_PER_STAGE_DURATIONS = TypeAdapter(listing(Seconds, what="numbers of seconds", example=[0.02, 0.03]))


def _per_stage_seconds(value: Any) -> tuple[float, ...]:
    """One duration for every stage, or one per stage."""
    if isinstance(value, (list, tuple)):
        return _PER_STAGE_DURATIONS.validate_python(value)
    return (_ONE_DURATION.validate_python(value),)


PerStageSeconds = Annotated[
    tuple[float, ...],
    PlainValidator(_per_stage_seconds),
    Rule(f"a number of seconds in (0, {MAX_COMPUTATION_S:g}] or a list of them (one per stage)", 0.02),
]


class SimulatedWorkload(Section):
    """Seconds one forward/backward of one microbatch takes at the max clock, per stage.

    Only used with a simulated GPU: the runtime paces each computation to this duration at the
    current clock (the real CPU work counts towards it), so energy and time follow the GPU model
    while the training math is untouched.
    """

    example: ClassVar[dict[str, Any]] = {"forward_seconds": 0.02, "backward_seconds": 0.04}

    forward_seconds: Annotated[PerStageSeconds, Field(description="one microbatch's forward at the max clock")]
    backward_seconds: Annotated[PerStageSeconds, Field(description="one microbatch's backward at the max clock")]

    def seconds(self, stage: int, kind: str) -> float:
        table = self.forward_seconds if kind == "forward" else self.backward_seconds
        return table[stage] if len(table) > 1 else table[0]

    def check_stages(self, num_stages: int) -> None:
        for name in ("forward_seconds", "backward_seconds"):
            values = getattr(self, name)
            if len(values) not in (1, num_stages):
                raise ConfigError(
                    f"{PREFIX}.simulated_workload.{name} has {len(values)} entries but the "
                    f"pipeline has {num_stages} stages; give one number or one per stage"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"forward_seconds": list(self.forward_seconds), "backward_seconds": list(self.backward_seconds)}


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
                f"/metrics on port + local rank) or {PREFIX}.prometheus.pushgateway, e.g. {{\"port\": 9400}}"
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


def _saved_sidecar(profile_path: str, *, need_blocking_power: bool) -> ProfileSidecar | None:
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


def _profile_path(path: str) -> str:
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


# ------------------------------------------------------------------------------ the GPU
def _known_gpu_spec(spec: str) -> str:
    """A simulated preset or option that does not exist fails here, naming `perseus.gpu`."""
    try:
        check_gpu_spec(spec)
    except ConfigError as err:
        raise value_error(f"{show(spec)}: {str(err).removeprefix(f'GPU spec {spec!r}: ')}") from None
    return spec


def _gpu_spec_shape(spec: str) -> bool:
    """"nvml", "sim:<preset>...", "zeusd" or "zeusd:<reading backend>" (the simulator's seam)."""
    spec = spec.strip()
    if spec == "zeusd" or spec.startswith("zeusd:"):
        spec = spec.partition(":")[2] or "nvml"
    return spec == "nvml" or spec.startswith("sim:")


def resolved_gpu_spec(gpu: str | None) -> str:
    """The GPU backend a rank will open: the key, else env PERSEUS_GPU, else NVML."""
    return (gpu if gpu is not None else os.environ.get(GPU_ENV, "nvml")).strip()


# ------------------------------------------------------------------------------ the section
Clock = integer(1, example=1410, what="a clock in MHz")
Iterations = integer(0, example=2)
AtLeastOne = integer(1, example=2)
Fraction = number(example=0.05, above=0, below=1)


class PerseusConfig(Section):
    """Every knob of the runtime; `key_table_markdown()` renders this model for the docs."""

    example: ClassVar[dict[str, Any]] = {"enabled": True}

    enabled: Annotated[flag(example=True), Field(
        description="Attach perseus-ext to this job. A disabled section is still validated.")] = False
    mode: Annotated[choice(Mode, example="observe"), Field(
        description="`observe` never touches clocks: it only measures and logs time and energy per iteration "
                    "(and paces a simulated GPU) — the baseline for comparisons.")] = Mode.OPTIMIZE
    gpu: Annotated[
        Annotated[str, Rule('"nvml", "zeusd" or "sim:<preset>[?options]"', "sim:a100_sxm", _gpu_spec_shape),
                  AfterValidator(_known_gpu_spec)] | None,
        Field(description="GPU backend: `\"nvml\"`, `\"zeusd\"` (clock and power-limit changes through the zeusd "
                          "daemon at `ZEUSD_SOCK_PATH` or `ZEUSD_HOST_PORT`, bearer token `ZEUSD_TOKEN`; reads "
                          "through NVML) or `\"sim:<preset>[?options]\"` (presets `a100_sxm`, `a40`, `h100`; see "
                          "docs/device.md). `null` reads env `PERSEUS_GPU`, default `nvml`. Whatever the backend, "
                          "when a zeusd variable is set and the process may not set clocks itself, changes go "
                          "through zeusd.")] = None
    seed: Annotated[integer(0, example=0), Field(
        description="Base seed of simulated GPUs (rank r uses seed + r).")] = 0
    dry_run: Annotated[flag(example=True) | None, Field(
        description="`true`: never change clocks, only record them. `null`: dry-run automatically when this "
                    "process lacks permission to set clocks.")] = None
    strict: Annotated[flag(example=True), Field(
        description="Fail at start-up (a ConfigError naming the missing privilege, or why zeusd cannot set "
                    "clocks) instead of falling back to dry-run when this process may not set GPU clocks.")] = False
    warmup_iterations: Annotated[Iterations, Field(
        description="Iterations at default clocks before profiling.")] = 2
    profiling_iterations_per_clock: Annotated[AtLeastOne, Field(
        description="Iterations each searched clock is profiled for. `1` suffices: the search stops only on "
                    "confident estimates and smooths power over the clocks; more = less noise, longer profiling. "
                    "While the energy counter's windows (NVML: an update about every 100 ms) cannot yet tell the "
                    "clocks apart, e.g. with iterations of a few tens of ms, the clocks are profiled once more (2 "
                    "rounds at most).")] = 1
    candidate_clocks: Annotated[
        Annotated[listing(Clock, what="clocks in MHz", example=[1410, 1200, 990], distinct=True),
                  AfterValidator(lambda clocks: tuple(sorted(clocks, reverse=True)))] | None,
        Field(description="Clocks to profile; each must be supported by the GPU (checked at initialize). "
                          "`null`: all supported clocks.")] = None
    clock_stride: Annotated[AtLeastOne, Field(
        description="Keep every k-th candidate clock, from the fastest. The search steps through the candidates "
                    "by about 1/16 of the max clock (90 MHz on an A100) anyway, so the default needs no tuning.")] = 1
    early_stop: Annotated[flag(example=False), Field(
        description="Stop a stage's clock search once lower clocks confidently cost more energy, also when a "
                    "wait is paid (energy − blocking power × time), so the planner keeps every useful clock.")] = True
    early_stop_patience: Annotated[AtLeastOne, Field(
        description="How many searched clocks below the most efficient one must each cost more by over two "
                    "standard errors before stopping.")] = 2
    blocking_power_w: Annotated[number(example=83.6, unit="watts", above=0) | None, Field(
        description="GPU power while blocked on communication. `null`: estimated while profiling (a profile "
                    "whose estimate fails is not saved: the next run profiles again), or read from an existing "
                    "`profile_path`'s `<path>.json`.")] = None
    profile_path: Annotated[
        Annotated[text(example="profiles/job.csv", what="a non-empty path"), AfterValidator(_profile_path)] | None,
        Field(description="Profile CSV (`stage,instruction,frequency,time,energy`) plus `<path>.json` (blocking "
                          "power). If the file exists, profiling is skipped; otherwise the first pipeline saves "
                          "its profile there, so a restarted job skips profiling.")] = None
    frontier_path: Annotated[output_path(example="frontier.json") | None, Field(
        description="Where the first pipeline saves its frontier (JSON; read by `perseus-ext frontier` tooling "
                    "and the demo plot).")] = None
    solve_in_background: Annotated[flag(example=False), Field(
        description="Solve the frontier in a child process while training continues; `false` solves inline "
                    "(blocks one iteration).")] = True
    if TYPE_CHECKING:
        solver: SolverOptions | None
    else:
        solver: Annotated[
            Any,
            dataclass_section(lambda: SolverOptions, SOLVER_BOUNDS, where=f"{PREFIX}.solver",
                              example=_SOLVER_EXAMPLE, errors=(SolverError,)),
            Rule("an object of frontier-solver options", _SOLVER_EXAMPLE),
            Field(description="Options of the frontier solver, the fields of "
                              "`perseus_ext.planning.solver.SolverOptions` (e.g. `{\"min_grid_points\": 300}` for "
                              "a faster, coarser frontier); bounds in docs/deepspeed.md.")] = None
    control_timeout_s: Annotated[
        number(example=1800, unit="seconds", at_least=CONTROL_TIMEOUT_RANGE_S[0], at_most=CONTROL_TIMEOUT_RANGE_S[1]),
        Field(description="Timeout of perseus-ext's own gloo collectives; after it a rank falls back to default "
                          "clocks instead of waiting forever. Must exceed the longest gap between iterations "
                          "(e.g. checkpointing).")] = 1800.0
    straggler_check_interval: Annotated[integer(1, example=10), Field(
        description="Iterations between straggler checks (one tiny all-gather each).")] = 10
    straggler_threshold: Annotated[Fraction, Field(
        description="A pipeline slows down only if the slowest pipeline takes this much longer (relative to "
                    "the fastest plan's time).")] = 0.05
    straggler_hysteresis: Annotated[number(example=0.02, at_least=0, below=1), Field(
        description="Plans move only when the target changes by more than this; recovery below threshold − "
                    "hysteresis. Must be below `straggler_threshold`.")] = 0.02
    straggler_confirmations: Annotated[AtLeastOne, Field(
        description="Consecutive checks that must ask for a slower plan before it happens (a transient hiccup "
                    "slows nothing down); faster plans are taken at once.")] = 2
    baseline_fraction: Annotated[number(example=0.01, at_least=0, at_most=0.5), Field(
        description="Share of deployed iterations run at default clocks as baseline probes (about one in "
                    "`1 / fraction`, the same iterations on every rank, never next to a straggler check or plan "
                    "switch): the measured saving and its confidence interval come from them. The first 50 deployed "
                    "iterations probe at least one in 12, so a job of 50 deployed iterations gets a measured saving "
                    "with its interval. `0` = no probes, no measured saving.")] = 0.01
    communication_clock: Annotated[
        int | Literal["min"] | None,
        Rule('null, "min" or a clock in MHz (an integer >= 1)', "min",
             lambda v: v is None or v == "min" or v >= 1),
        Field(description="Clock in force on the device between computations, while a stage waits for its next "
                          "input (deployed plans only; each computation's own clock is issued at its start, so "
                          "computations pay the switching latency); `\"min\"` = the GPU's lowest clock.")] = None
    log_interval: Annotated[integer(0, example=10), Field(
        description="Log one concise line (phase, plan, time, energy, measured saving) every N iterations on "
                    "rank 0 (other ranks at DEBUG); `0` = off.")] = 100
    log_path: Annotated[rank_template(example="logs/perseus-{rank}.jsonl") | None, Field(
        description="JSONL file with one record per iteration as the device ran it (timestamp, rank, stage, "
                    "phase, plan, time, energy, clock coverage), appended across restarts; `{rank}` (the only "
                    "placeholder) is replaced by the global rank. Its directory must be creatable.")] = None
    summary_path: Annotated[rank_template(example="logs/summary-{rank}.json") | None, Field(
        description="JSON summary per rank written at the end; `{rank}` as above.")] = None
    simulated_workload: Annotated[
        Annotated[SimulatedWorkload, Rule("an object", SimulatedWorkload.example)] | None,
        Field(description="Simulated GPUs only: `{\"forward_seconds\": s or [s per stage], \"backward_seconds\": "
                          "...}`, the duration of one microbatch's forward/backward at the max clock. Each "
                          "computation launches that much work on the simulated device, which runs it "
                          "asynchronously at its effective clock (time and energy follow the GPU model, the math "
                          "is untouched).")] = None
    policy: Annotated[
        Annotated[PolicyConfig, Rule("an object", PolicyConfig.example)] | None,
        Field(description="Which frontier plan to run: `null` = Perseus' straggler policy; Zeus/Chase cost "
                          "policies (`{\"type\": \"zeus\", \"eta\": 0.5}`, `{\"type\": \"chase\", \"carbon\": "
                          "{\"csv\": ...}}`); the fastest plan within a power budget (`{\"type\": \"power_budget\", "
                          "\"budget\": {\"watts\": 300}}`). `\"mode\": \"power_limit\"` instead keeps default clocks "
                          "and picks one global GPU power limit (Zeus). `\"batch_size\": {\"store\": ..., ...}` "
                          "makes each run of a recurring job take its batch size from a store and report its cost "
                          "(`engine.perseus.report_metric(value)`; PerseusEarlyStop past its cost limit). Keys: "
                          "docs/policies.md.")] = None

    prometheus: Annotated[
        Annotated[PrometheusConfig, Rule("an object", PrometheusConfig.example)] | None,
        Field(description="Per-rank Prometheus metrics (energy, power, clock, phase, plan, coverage, measured "
                          "saving; labels job, rank, stage, pipeline): `{\"port\": 9400}` serves /metrics on "
                          "port + local rank, `\"pushgateway\": URL` pushes every `push_interval_s` (15) and at "
                          "the end; also `address`, `job`. `null`: env `PERSEUS_PROMETHEUS_PORT` / "
                          "`PERSEUS_PUSHGATEWAY`, else off. docs/monitoring.md.")] = None

    _profile_sidecar: ProfileSidecar | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _keys_agree(self) -> PerseusConfig:
        if self.straggler_hysteresis >= self.straggler_threshold:
            raise statement_error(
                f"{PREFIX}.straggler_hysteresis ({self.straggler_hysteresis:g}) must be smaller than "
                f"{PREFIX}.straggler_threshold ({self.straggler_threshold:g}), or plans would never return "
                f"after a straggler recovers; e.g. 0.02 and 0.05"
            )
        if self.gpu is None and os.environ.get(GPU_ENV, "").strip():  # the key's fallback is checked as the key
            try:
                check_gpu_spec(resolved_gpu_spec(None))
            except ConfigError as err:
                raise statement_error(f"{PREFIX}.gpu is null, so env {GPU_ENV} names the GPU: {err}; fix {GPU_ENV} "
                                      f"or set {PREFIX}.gpu") from None
        if self.simulated_workload is not None and not resolved_gpu_spec(self.gpu).removeprefix("zeusd:").startswith("sim:"):
            where = f"{PREFIX}.gpu" if self.gpu is not None else f"{PREFIX}.gpu (null: env {GPU_ENV}, default nvml)"
            raise statement_error(
                f"{PREFIX}.simulated_workload paces work on a simulated GPU, but {where} is "
                f"{show(resolved_gpu_spec(self.gpu))}: set {PREFIX}.gpu to \"sim:a100_sxm\" (a CPU machine, "
                f"or a test of the loop) or drop {PREFIX}.simulated_workload (a real GPU)"
            )
        if self.profile_path is not None and Path(self.profile_path).is_file():
            try:
                self._profile_sidecar = _saved_sidecar(self.profile_path,
                                                       need_blocking_power=self.blocking_power_w is None)
            except ConfigError as err:
                raise statement_error(str(err)) from None
        return self

    @classmethod
    def from_dict(cls, data: Any) -> PerseusConfig:
        """Validate a `"perseus"` section (None: all defaults, disabled); a ConfigError names
        every bad key."""
        return parse(cls, {} if data is None else data, root=PREFIX)

    @property
    def saved_profile_sidecar(self) -> ProfileSidecar | None:
        """What `<profile_path>.json` says about an existing profile (read once, at the door)."""
        return self._profile_sidecar

    @property
    def saved_blocking_power_w(self) -> float | None:
        """The blocking power saved next to an existing `profile_path` (read at the door), used
        when `blocking_power_w` is null."""
        if self.blocking_power_w is not None or self._profile_sidecar is None:
            return None
        return self._profile_sidecar.blocking_power_w

    def to_dict(self) -> dict[str, Any]:
        """The section as plain values; `from_dict(config.to_dict()) == config`."""
        return self.model_dump()


# ------------------------------------------------------------------------------ documentation
def _type_and_default(name: str) -> str:
    info = PerseusConfig.model_fields[name]
    kind = field_rule(PerseusConfig, name).requirement.replace("|", "\\|")
    if info.default is None and not kind.startswith("null"):
        kind += " \\| null"
    return f"{kind}, `{json.dumps(info.get_default(call_default_factory=True))}`"


def key_table_markdown() -> str:
    """The key table of README.md and docs/deepspeed.md, generated from the model (a test keeps
    both files equal to it)."""
    rows = ["| key | type / default | meaning |", "|---|---|---|"]
    rows += [
        f"| `{name}` | {_type_and_default(name)} | {info.description} |"
        for name, info in PerseusConfig.model_fields.items()
    ]
    return "\n".join(rows)
