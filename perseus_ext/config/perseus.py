"""The `"perseus"` configuration section: one typed model, validated completely at the door.

Why: the section arrives inside a framework config (a DeepSpeed JSON file, Megatron flags), so
every mistake knowable without a GPU must fail at `deepspeed.initialize` / Megatron `install`
with a message naming `perseus.<key>` (nested: `perseus.policy.eta`,
`perseus.solver.min_grid_points`) and the fix, not hours later inside a training step. The
`gpu` spec, the `policy` and `solver` sub-sections come out typed (`GpuSpec`, `PolicySection`,
`SolverOptions`), output paths are checked to be writable, and a saved profile's side file is
read here. What needs the GPU or the pipeline (are the candidate clocks supported? which clock
is "min"? does a saved profile fit this pipeline and GPU?) is the runtime's.

The same model generates the Megatron `--perseus-<key>` flags
(`perseus_ext.adapters.megatron_args`) and the key table of README.md and docs/deepspeed.md
(`perseus_ext.config.key_table`). Validating a section imports neither torch nor numpy nor a
database driver (the import contract forbids them here).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, PrivateAttr, model_validator

from perseus_ext.config.gpu import ENV_GPU, GpuSpec, gpu_spec_from_env, is_simulated, parse_gpu_spec
from perseus_ext.config.policy import PolicySection
from perseus_ext.config.rules import (
    Rule,
    Section,
    StrChoice,
    choice,
    dataclass_section,
    flag,
    integer,
    listing,
    number,
    output_path,
    parse,
    rank_template,
    show,
    statement_error,
    text,
    value_error,
)
from perseus_ext.config.sections import (
    PREFIX,
    PrometheusConfig,
    ProfileSidecar,
    SimulatedWorkload,
    check_profile_path,
    saved_sidecar,
)
from perseus_ext.errors import ConfigError, SolverError

if TYPE_CHECKING:
    from perseus_ext.planning.options import SolverOptions

CONTROL_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)  # a second .. a week


class Mode(StrChoice):
    """`optimize` plans and sets clocks; `observe` only measures (the baseline)."""

    OPTIMIZE = "optimize"
    OBSERVE = "observe"


# ------------------------------------------------------------------------------ solver options
def _solver_options() -> type:
    """The solver's option dataclass, imported when a section has a `solver` key (it is plain
    Python: its module imports nothing heavier than `math`)."""
    from perseus_ext.planning.options import SolverOptions

    return SolverOptions


def solver_bounds() -> dict[str, Any]:
    """Door rules of every `SolverOptions` field, from the solver's own bounds (one table:
    `perseus_ext.planning.options.BOUNDS`): beyond them its grid or LP count (and its memory)
    explodes or the option is meaningless (e.g. a negative grid)."""
    from perseus_ext.planning.options import BOUNDS

    rules: dict[str, Any] = {}
    for option in dataclasses.fields(_solver_options()):
        default = option.default
        if isinstance(default, bool):
            rules[option.name] = flag(example=default)
            continue
        low, high = BOUNDS[option.name]
        if isinstance(default, int):
            rules[option.name] = integer(int(low), int(high), example=default)
        else:
            rules[option.name] = number(example=default, at_least=low, at_most=high)
    return rules


_SOLVER_EXAMPLE = {"min_grid_points": 300}


# ------------------------------------------------------------------------------ the GPU
def _gpu_spec(value: Any) -> Any:
    """A spec string parsed once, here; a typo fails naming `perseus.gpu`."""
    if not isinstance(value, str):
        return value
    try:
        return parse_gpu_spec(value)
    except ConfigError as err:
        raise value_error(f"{show(value)}{str(err).removeprefix(f'GPU spec {value.strip()!r}')}") from None


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
        Annotated[GpuSpec, BeforeValidator(_gpu_spec), PlainSerializer(str, return_type=str),
                  Rule('"nvml", "zeusd" or "sim:<preset>[?options]"', "sim:a100_sxm")] | None,
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
        Annotated[text(example="profiles/job.csv", what="a non-empty path"), AfterValidator(check_profile_path)] | None,
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
            dataclass_section(_solver_options, solver_bounds, where=f"{PREFIX}.solver",
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
        description="Iterations between straggler checks. A check is two element-wise max all-reduces of a "
                    "few floats over gloo (within the pipeline, then among its data-parallel peers) and, once the "
                    "pipeline has device records, a broadcast of the pipeline leader's choice (two floats); each is started at "
                    "one iteration boundary and collected at the next, so training does not wait for them.")] = 10
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
    megatron_iteration_log: Annotated[flag(example=True), Field(
        description="Megatron-LM only: append this rank's perseus-ext energy and time per iteration and its "
                    "phase to Megatron-LM's iteration log line.")] = False
    simulated_workload: Annotated[
        Annotated[SimulatedWorkload, Rule("an object", SimulatedWorkload.example)] | None,
        Field(description="Simulated GPUs only: `{\"forward_seconds\": s or [s per stage], \"backward_seconds\": "
                          "...}`, the duration of one microbatch's forward/backward at the max clock. Each "
                          "computation launches that much work on the simulated device, which runs it "
                          "asynchronously at its effective clock (time and energy follow the GPU model, the math "
                          "is untouched). Split-backward schedules' input- and weight-gradient computations take "
                          "the backward's shares by the planner's derivation rule (docs/schedules.md). "
                          "`\"reduce_grad_seconds\"` (s or [s per stage] in [0, 3600], default 0): a gradient sync "
                          "action's work (torch.distributed.pipelining's REDUCE_GRAD, once per model chunk).")] = None
    policy: Annotated[
        Annotated[PolicySection, Rule("an object", PolicySection.example)] | None,
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
    _gpu_spec: GpuSpec = PrivateAttr(default=None)  # type: ignore[assignment] # set by _keys_agree

    @model_validator(mode="after")
    def _keys_agree(self) -> PerseusConfig:
        if self.straggler_hysteresis >= self.straggler_threshold:
            raise statement_error(
                f"{PREFIX}.straggler_hysteresis ({self.straggler_hysteresis:g}) must be smaller than "
                f"{PREFIX}.straggler_threshold ({self.straggler_threshold:g}), or plans would never return "
                f"after a straggler recovers; e.g. 0.02 and 0.05",
                [f"{PREFIX}.straggler_hysteresis", f"{PREFIX}.straggler_threshold"],
            )
        if self.gpu is not None:
            self._gpu_spec = self.gpu
        else:  # env PERSEUS_GPU names the GPU: checked here, as the key would be
            try:
                self._gpu_spec = gpu_spec_from_env()
            except ConfigError as err:
                raise statement_error(f"{PREFIX}.gpu is null, so env {ENV_GPU} names the GPU: {err}; fix {ENV_GPU} "
                                      f"or set {PREFIX}.gpu", [f"{PREFIX}.gpu"]) from None
        if self.simulated_workload is not None and not is_simulated(self._gpu_spec):
            where = f"{PREFIX}.gpu" if self.gpu is not None else f"{PREFIX}.gpu (null: env {ENV_GPU}, default nvml)"
            raise statement_error(
                f"{PREFIX}.simulated_workload paces work on a simulated GPU, but {where} is "
                f"{show(str(self._gpu_spec))}: set {PREFIX}.gpu to \"sim:a100_sxm\" (a CPU machine, "
                f"or a test of the loop) or drop {PREFIX}.simulated_workload (a real GPU)",
                [f"{PREFIX}.simulated_workload", f"{PREFIX}.gpu"],
            )
        if self.profile_path is not None and Path(self.profile_path).is_file():
            try:
                self._profile_sidecar = saved_sidecar(self.profile_path,
                                                       need_blocking_power=self.blocking_power_w is None)
            except ConfigError as err:
                raise statement_error(str(err), [f"{PREFIX}.profile_path"]) from None
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

    @property
    def gpu_spec(self) -> GpuSpec:
        """The GPU this job opens: the `gpu` key, else env PERSEUS_GPU (default nvml), parsed
        once at the door."""
        return self._gpu_spec

    def to_dict(self) -> dict[str, Any]:
        """The section as plain values; `from_dict(config.to_dict()) == config`."""
        return self.model_dump()


