"""Megatron integration: `--perseus` flags and per-computation clocks in megatron-core's schedules.

The adapter is thin: planning, profiling, clock control and straggler handling live in
`perseus_ext.runtime.PerseusRuntime` (shared with the DeepSpeed adapter). This module adds the
`--perseus*` argument group (`megatron_args`, usable as Megatron-LM's `extra_args_provider`) and
wraps, in `megatron.core.pipeline_parallel.schedules`, exactly the functions `PATCH_SURFACES`
lists for the installed release (0.16 to 0.19): the schedule functions (one call = one training
iteration) and the step functions they call, so every computation reports (kind, microbatch,
chunk) to the runtime right before and after it runs (`megatron_steps` says how each step is
placed), and it marks the end of the stage's computations (the data-parallel gradient sync that
follows must not count for straggler detection). Communication needs no hook: the runtime orders
clock changes by device markers at computation boundaries, which is where receives wait.

The plan lists each stage's computations in the order `perseus_ext.planning.schedule` predicts
(interleaved with megatron's own `microbatch_group_size_per_vp_stage`); with
`--overlap-moe-expert-parallel-comm` the units of megatron-core's combined_1f1b schedule, hooked
where megatron-core runs them (`megatron_combined`). On the first mismatch (a release that
reorders work, ...) a rank logs one error naming both computations and runs at default clocks
from then on, still joining the runtime's collectives; training is never interrupted. A changed
number of microbatches (Megatron's batch-size ramp-up)
re-plans through `PerseusRuntime.reschedule`. Two things are errors rather than silent no-ops: a
step function running outside any wrapped schedule (the script bound `get_forward_backward_func()`
or a schedule function before `install()`), and `optimize` mode without pipeline parallelism
(observe and power-limit modes work with PP = 1).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from perseus_ext.adapters.common import check_mode, start_runtime
from perseus_ext.adapters.megatron_args import (
    NO_PIPELINE_FIX,
    add_perseus_args,
    apply_run_batch_size,
    chain_extra_args,
    config_from_args,
)
from perseus_ext.adapters.megatron_combined import COMBINED_MODULE, INTERLEAVED_UNIT, NO_PIPELINING_UNIT, runs_combined, wrap_unit
from perseus_ext.adapters.megatron_graphs import GraphMode, MegatronExecution, detect, execution_notes
from perseus_ext.adapters.megatron_layout import check_layout
from perseus_ext.adapters.megatron_steps import (
    IterationSteps,
    data_parallel_group,
    local_device,
    microbatch_group_size,
    model_config,
    pipeline_group,
    planned_schedule,
)
from perseus_ext.adapters.megatron_surface import (
    NO_PIPELINING,
    PATCH_SURFACES,
    SCHEDULES_MODULE,
    WITH_INTERLEAVING,
    PatchSurface,
    installed_version,
    patch_surface,
    release_of,
)
from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import Kind, PipelineSchedule
from perseus_ext.policies.factories import target_metric

log = logging.getLogger("perseus_ext.megatron")
__all__ = ["MegatronPerseus", "PATCH_SURFACES", "add_perseus_args", "chain_extra_args",
           "config_from_args", "install"]

_FULL_GRAPH_MODULE = "megatron.core.full_cuda_graph"  # FullCudaGraphWrapper (full-iteration graphs)
_GRAPH_CALL = "FullCudaGraphWrapper.__call__"


def _pipeline_size(args: Any) -> int | None:
    value = getattr(args, "pipeline_model_parallel_size", None)
    return value if isinstance(value, int) else None




def _check_mode(config: Any, num_stages: int, where: str) -> None:
    """`optimize` plans per-computation clocks across pipeline stages; without a pipeline only
    observe and power-limit modes apply (both need nothing but iteration boundaries)."""
    check_mode(config, has_pipeline=num_stages > 1, without_pipeline=f"{where} runs without pipeline parallelism",
               fix=NO_PIPELINE_FIX)


class MegatronPerseus:
    """Perseus on megatron-core's pipeline schedules for this process.

    Created by `install()`. The runtime is built on the first training iteration, once
    megatron's parallel state, the schedule and the number of microbatches are known (every
    rank gets there at the same time, which the runtime's own process groups require).
    """

    def __init__(
        self,
        args: argparse.Namespace | None,
        *,
        gpu: Any = None,
        policy: Any = None,
        tensorboard_writer: Any = None,
        wandb_writer: Any = None,
    ) -> None:
        self._args = args
        self._gpu = gpu
        self._policy = policy
        self._writers = (tensorboard_writer, wandb_writer)
        self.metrics: Any = None
        self._config: Any = None
        self._prepared_run: Any = None  # this run's batch size from the store (install(args))
        self.runtime: Any = None
        self.schedule: PipelineSchedule | None = None
        self.stage: int | None = None
        self.surface: PatchSurface | None = None
        self._iteration: IterationSteps | None = None
        self.in_unit = False  # inside one of combined_1f1b's units: step hooks pass through
        self._schedule_depth = 0  # wrapped schedule calls in progress (evaluation included)
        self._unidentified: str | None = None
        self._originals: dict[str, Callable] = {}
        self._schedules: dict[tuple, PipelineSchedule] = {}
        self.execution: MegatronExecution | None = None  # CUDA graphs / combined_1f1b, from args or model config
        self._graph_call = False  # inside a FullCudaGraphWrapper call: the replay is the iteration
        self._closed = False
        self._restore_log: Callable[[], None] | None = None  # install(iteration_log=True)

    # ---- installation ------------------------------------------------------------------

    def _patch(self) -> None:
        module = importlib.import_module(SCHEDULES_MODULE)
        version = installed_version()
        surface = patch_surface(version)
        missing = [name for name in surface.names if not callable(getattr(module, name, None))]
        if missing:
            raise ConfigError(f"perseus: megatron-core {version} has no {', '.join(missing)} in "
                              f"{SCHEDULES_MODULE}; perseus-ext hooks megatron-core 0.16 to 0.19")
        wrappers = {name: self._wrap_schedule(getattr(module, name)) for name in surface.schedules}
        wrappers.update({name: self._wrap_step(getattr(module, name), Kind.FORWARD)
                         for name in surface.forward_steps})
        wrappers.update({name: self._wrap_step(getattr(module, name), Kind.BACKWARD)
                         for name in surface.backward_steps})
        for name, wrapper in wrappers.items():
            self._originals[name] = getattr(module, name)
            setattr(module, name, wrapper)
        for unit_module, name, interleaved_path in ((SCHEDULES_MODULE, INTERLEAVED_UNIT, True),
                                                    (COMBINED_MODULE, NO_PIPELINING_UNIT, False)):
            owner = importlib.import_module(unit_module)
            original = getattr(owner, name, None)
            if callable(original):  # a release without it runs a combined job unhooked: default clocks
                self._originals[f"{unit_module}:{name}"] = original
                setattr(owner, name, wrap_unit(self, original, interleaved=interleaved_path))
        self.surface = surface

    def _unpatch(self) -> None:
        module = importlib.import_module(SCHEDULES_MODULE)
        graph_call = self._originals.pop(_GRAPH_CALL, None)
        if graph_call is not None:
            importlib.import_module(_FULL_GRAPH_MODULE).FullCudaGraphWrapper.__call__ = graph_call
        for name, original in self._originals.items():
            owner, _, attribute = name.rpartition(":")
            setattr(importlib.import_module(owner) if owner else module, attribute, original)
        self._originals.clear()

    def _patch_graph_call(self) -> None:
        """Make each `FullCudaGraphWrapper` call one perseus-ext iteration (full-iteration
        graphs): after the capture it only replays, and no hook inside it would run."""
        if _GRAPH_CALL in self._originals:
            return
        wrapper_class = importlib.import_module(_FULL_GRAPH_MODULE).FullCudaGraphWrapper
        self._originals[_GRAPH_CALL] = wrapper_class.__call__
        wrapper_class.__call__ = self._wrap_graph_call(wrapper_class.__call__)

    def adopt_execution(self, source: Any) -> None:
        """Read the job's CUDA-graph mode and combined_1f1b from `source` (the parsed arguments,
        or the model's TransformerConfig at the first iteration) and say, once, how each is
        planned (`execution_notes`). A source that shows nothing special keeps what an earlier
        one said."""
        execution = detect(source, release_of(installed_version()))
        special = execution.graph_mode is not GraphMode.NONE or execution.combined_1f1b
        if self.execution is not None and (not special or execution == self.execution):
            return
        self.execution = execution
        if not special or self._config is None:
            return
        if execution.graph_mode is GraphMode.FULL_ITERATION:
            self._patch_graph_call()
        for note in execution_notes(execution):
            log.info("%s", note)

    # ---- wrappers --------------------------------------------------------------------------

    def _wrap_schedule(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run_iteration(*args: Any, **kwargs: Any) -> Any:
            if self._iteration is not None or self._closed:  # nested call / uninstalled
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._schedule_depth += 1
            try:
                if bound.get("forward_only") or not self._start_iteration(bound, original):
                    return original(*args, **kwargs)
                try:
                    result = original(*args, **kwargs)
                except BaseException:
                    # Training is failing anyway; skipping iteration_end (which may run
                    # collectives with ranks that are not coming) lets the error surface
                    # instead of a hang.
                    self._iteration = None
                    raise
            finally:
                self._schedule_depth -= 1
            self._iteration = None
            self.runtime.iteration_end()
            self.metrics.write()
            return result

        return run_iteration

    def _wrap_graph_call(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def run_graph_iteration(graph: Any, *args: Any, **kwargs: Any) -> Any:
            if self._closed or self._graph_call or kwargs.get("forward_only"):
                return original(graph, *args, **kwargs)
            self._schedule_depth += 1
            self._graph_call = True
            try:
                # The wrapped schedule (looked up after install()) names the pipeline's schedule.
                if not self._start_iteration(kwargs, graph.forward_backward_func, whole=True):
                    return original(graph, *args, **kwargs)
                try:
                    result = original(graph, *args, **kwargs)  # eager warm-up, capture + replay, or replay
                except BaseException:
                    self._iteration = None
                    raise
            finally:
                self._graph_call = False
                self._schedule_depth -= 1
            self._iteration = None
            self.runtime.iteration_end()
            self.metrics.write()
            return result

        return run_graph_iteration

    def _wrap_step(self, original: Callable, kind: Kind) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run_step(*args: Any, **kwargs: Any) -> Any:
            iteration = self._iteration
            if self._graph_call or self.in_unit:  # a graph's eager/captured run, or inside a combined unit
                return original(*args, **kwargs)
            if iteration is None:
                if self._schedule_depth == 0 and not self._closed:
                    self._step_outside_schedule(original.__name__)
                return original(*args, **kwargs)
            identity = self._identify(iteration, kind, signature.bind_partial(*args, **kwargs).arguments)
            if identity is None:  # the runtime fell back: default clocks for this rank
                return original(*args, **kwargs)
            microbatch, chunk = identity
            self.runtime.before_computation(kind, microbatch, chunk=chunk)
            result = original(*args, **kwargs)
            if kind is Kind.FORWARD:
                iteration.remember_output(identity, result)
            self.runtime.after_computation(kind, microbatch, chunk=chunk)
            iteration.position += 1
            if iteration.position == len(iteration.order):
                self.runtime.mark_compute_end()  # what follows is the data-parallel grad sync
            return result

        return run_step

    def _step_outside_schedule(self, step: str) -> None:
        """megatron-core's `step` ran, but no schedule perseus-ext wrapped called it: the script
        holds a schedule function it looked up before `install()`."""
        if self._resolve_config() is None:  # --perseus off: nothing to hook, step aside
            return
        raise ConfigError(
            f"perseus: megatron-core's {step} ran outside every pipeline schedule perseus-ext "
            f"hooked: the training script bound get_forward_backward_func() (or imported a "
            f"forward_backward_* function) before perseus_megatron.install(); call install() "
            f"first, then get_forward_backward_func()")

    def _identify(self, iteration: IterationSteps, kind: Kind, bound: dict) -> tuple[int, int] | None:
        """(microbatch, chunk) of the computation megatron is about to run (`IterationSteps.place`);
        a step it cannot place makes the rank fall back to default clocks (one error, training
        goes on), as does any computation the runtime finds out of the plan's order."""
        if self._unidentified is not None:
            return None
        placed = iteration.place(kind, bound, schedule_kind=self.schedule.kind.value, stage=self.stage)
        return self._cannot_identify(placed) if isinstance(placed, str) else placed

    def _cannot_identify(self, what: str) -> None:
        self._unidentified = what
        self.runtime.fall_back(f"megatron-core ran {what}, which perseus cannot place in the plan")
        return None

    # What `megatron_combined.wrap_unit` reads and calls.
    current_iteration = property(lambda self: None if self._graph_call else self._iteration)
    fell_back_on_order = property(lambda self: self._unidentified is not None)

    def cannot_place(self, what: str) -> None:
        self._cannot_identify(what)

    def check_unit_outside_iteration(self, function: str) -> None:
        if self._schedule_depth == 0 and not self._closed and not self._graph_call:
            self._step_outside_schedule(function)

    def _start_iteration(self, bound: dict, original: Callable, whole: bool = False) -> bool:
        models = bound.get("model")
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        if self.runtime is None and not self._build_runtime(bound, original, models, whole):
            return False
        if self.runtime.whole_iterations != whole:
            # Full-iteration graphs: a schedule call outside the wrapper (or a wrapper call in a
            # job whose runtime runs per computation) cannot be planned like the others.
            self.runtime.fall_back("megatron-core ran its schedule both inside and outside "
                                   "FullCudaGraphWrapper; perseus-ext plans one of the two")
        schedule = self._schedule_of(bound, original, models)
        if schedule != self.schedule:  # e.g. Megatron's batch-size ramp-up: same on every rank
            log.info("perseus: megatron-core now runs %s; re-planning", schedule.describe())
            self.runtime.reschedule(schedule)
            self.schedule = schedule
        self._iteration = IterationSteps(models=models, order=schedule.orders[self.stage],
                                     forwards_per_chunk=[0] * len(models))
        self.runtime.iteration_start()
        return True

    def _schedule_of(self, bound: dict, original: Callable, models: list[Any]) -> PipelineSchedule:
        """The `PipelineSchedule` this schedule call runs (cached: it is the same every iteration)."""
        num_microbatches = bound.get("num_microbatches")
        if not isinstance(num_microbatches, int):
            raise ConfigError("perseus: megatron-core's schedule was called without an integer "
                              "num_microbatches; pass it by keyword as megatron-core documents")
        name = original.__name__
        group = microbatch_group_size(models[0]) if name == WITH_INTERLEAVING else None
        # megatron-core takes its combined path on the first chunk's config, in these two only
        combined = name in (WITH_INTERLEAVING, NO_PIPELINING) and runs_combined(model_config(models[0]))
        key = (name, num_microbatches, len(models), group, combined)
        if key not in self._schedules:
            num_stages = 1 if name == NO_PIPELINING else self._pp_group(bound).size()
            self._schedules[key] = planned_schedule(name, num_stages, num_microbatches, len(models), group, combined)
        return self._schedules[key]

    # ---- runtime --------------------------------------------------------------------------

    def _resolve_config(self) -> Any:
        """The PerseusConfig (None: --perseus off, and then every hook is removed for good)."""
        if self._config is None and not self._closed:
            if self._args is None:
                from megatron.training import get_args

                self._args = get_args()
            self._config = config_from_args(self._args)
            if self._config is None:
                self._closed = True
                self._unpatch()
            else:
                self.adopt_execution(self._args)
        return self._config

    _pp_group = staticmethod(pipeline_group)
    _dp_group = staticmethod(data_parallel_group)
    _local_device = staticmethod(local_device)

    def _build_runtime(self, bound: dict, original: Callable, models: list[Any], whole: bool = False) -> bool:
        """First training iteration: build the schedule this stage runs and the runtime."""
        if self._resolve_config() is None:  # --perseus not given: stay out of the way for good
            return False
        chunk_config = model_config(models[0])
        if chunk_config is not None:
            self.adopt_execution(chunk_config)
            check_layout(chunk_config, self._config)
        config = self._config
        self.schedule = self._schedule_of(bound, original, models)
        _check_mode(config, self.schedule.num_stages, f"this job (megatron-core's {original.__name__})")
        pp_group = self._pp_group(bound) if self.schedule.num_stages > 1 else None
        self.stage = pp_group.rank() if pp_group is not None else 0
        from perseus_ext.observability.monitoring import megatron_sinks

        self.runtime, self.metrics = start_runtime(
            config,
            schedule=self.schedule,
            stage=self.stage,
            sinks=megatron_sinks(*self._writers),
            dp_group=self._dp_group(),
            pp_group=pp_group,
            gpu=self._gpu,
            policy=self._policy,
            local_rank=self._local_device(),
            whole_iterations=whole,
            prepared_run=self._prepared_run,
        )
        log.info("perseus: stage %d of %s", self.stage, self.schedule.describe())
        return True

    # ---- public ---------------------------------------------------------------------------

    @property
    def target(self) -> Any:
        """The `policy.batch_size.target_metric` (a TargetMetric) to report, None without one."""
        policy = getattr(self._config, "policy", None)
        return target_metric(policy)

    def report_metric(self, value: float) -> bool:
        """Hand one evaluation result of `policy.batch_size.target_metric` to perseus-ext (after
        the first training iteration); True once the target is reached."""
        if self.runtime is None:
            raise ConfigError("perseus: report_metric comes after the first training iteration "
                              "(the runtime is built there)")
        return self.runtime.report_metric(value)

    def summary(self) -> dict:
        """The runtime's per-rank summary plus the schedule the adapter observed."""
        summary = dict(self.runtime.summary()) if self.runtime is not None else {}
        summary["megatron"] = {
            "stage": self.stage,
            "schedule": self.schedule.describe() if self.schedule else None,
        }
        return summary

    def close(self) -> dict:
        """Restore megatron-core's functions and the default clocks; returns `summary()`.
        Idempotent; also runs at interpreter exit."""
        if not self._closed:
            self._closed = True
            self._unpatch()
            if self._restore_log is not None:
                self._restore_log()
        if self.runtime is not None:
            self.runtime.close()  # its close hook writes the last iterations' metrics
        return self.summary()


def install(
    args: argparse.Namespace | None = None,
    *,
    gpu: Any = None,
    policy: Any = None,
    tensorboard_writer: Any = None,
    wandb_writer: Any = None,
    iteration_log: bool = False,
) -> MegatronPerseus | None:
    """One call from a pretraining script, before it looks up `get_forward_backward_func()`:
    hook megatron-core's schedules.

    `args` are the parsed arguments carrying the `--perseus*` flags. A parser extended by
    `add_perseus_args` has validated them already (a bad flag ended the parse with argparse's
    usage and `error:` line); a namespace from elsewhere is validated here (a ConfigError naming
    the key and flag). None is returned when `--perseus` is off. Without `args`, Megatron-LM's
    global args (`megatron.training.get_args()`) are read at the first training iteration. What
    needs the job's processes (the batch-size store's choice against `--global-batch-size`) is
    checked here. One install per process at a time;
    `close()` undoes it. Per-iteration perseus metrics go to `tensorboard_writer` /
    `wandb_writer`, or by default to Megatron-LM's own writers (`perseus_ext.observability.monitoring`).
    `iteration_log=True` (or `--perseus-megatron-iteration-log`) also appends this rank's
    perseus-ext figures to Megatron-LM's iteration log line (`perseus_ext.adapters.megatron_log`), undone by `close()`.
    """
    global _INSTALLED
    if _INSTALLED is not None and not _INSTALLED._closed:
        raise ConfigError("perseus is already installed on megatron-core in this process; "
                          "close() the previous install first")
    config = prepared_run = None
    if args is not None:
        config = config_from_args(args)  # parsed with the arguments (add_perseus_args), else here
        if config is None:
            return None
        stages = _pipeline_size(args)
        if stages is not None:
            _check_mode(config, stages, "this job (--pipeline-model-parallel-size 1)")
        check_layout(args, config)
        prepared_run = apply_run_batch_size(args, config)  # the store's --global-batch-size, if asked for
    perseus = MegatronPerseus(args, gpu=gpu, policy=policy, tensorboard_writer=tensorboard_writer,
                              wandb_writer=wandb_writer)
    perseus._config = config
    perseus._prepared_run = prepared_run
    perseus._patch()
    if iteration_log or (config is not None and config.megatron_iteration_log):
        from perseus_ext.adapters.megatron_log import wrap_iteration_lines

        perseus._restore_log = wrap_iteration_lines(lambda: perseus.runtime.history if perseus.runtime else ())
    if args is not None:
        perseus.adopt_execution(args)
    atexit.register(perseus.close)
    _INSTALLED = perseus
    return perseus


_INSTALLED: MegatronPerseus | None = None
