"""DeepSpeed adapter: a `"perseus"` section in the DeepSpeed config is all it takes.

How it hooks the stock engines that `deepspeed.initialize` builds, without forking DeepSpeed:

* `install()` wraps `deepspeed.initialize`. Before the original runs (before DeepSpeed builds
  anything), the `"perseus"` section of the config given to it (dict, JSON file, base64 string
  or `args.deepspeed_config`) is parsed once into a `PerseusConfig` (`config_at_the_door`:
  ConfigError naming the key), the mode is checked against the model (a `PipelineModule` or
  not), and a batch-size policy gets this run's batch size from its store. When the section is
  enabled, `attach()` then hooks the engine instance with that typed config.
* A `PipelineEngine` gets every mode. `set_train_batch_size()` (a new number of microbatches)
  re-plans through `PerseusRuntime.reschedule` at the next `train_batch`;
  `set_train_micro_batch_size()` (more or less work per computation) profiles again through
  `PerseusRuntime.reprofile`.
* Any other engine has no pipeline, so only observe and power-limit modes apply (`optimize` is a
  ConfigError naming the alternatives): its instance `forward`/`backward`/`step` are wrapped, one
  iteration being the forward/backward pairs up to the optimizer step at the gradient
  accumulation boundary.
* For a pipeline engine, `attach()` gives the instance its own `_INSTRUCTION_MAP` (the engine looks the map up through
  `self`, so the class and other engines are untouched) and wraps its `_exec_schedule`: a
  `TrainSchedule` is swapped for `PerseusTrainSchedule`, which emits the same instructions but
  with forward/backward instructions that carry their microbatch id. Their handlers tell the
  runtime which computation runs next (a device marker recorded and the next clock queued on
  it; the device is synchronised around computations only in profiling iterations), then run
  DeepSpeed's own handler. `ReduceTiedGrads`/`ReduceGrads`
  mark the end of the pipeline's own compute (straggler detection must not count the
  data-parallel wait).
* `perseus_ext.autoload` (run by the installed `.pth` file) calls `install()` as soon as
  `deepspeed` is imported, so user scripts need no perseus import at all; with
  PERSEUS_AUTOLOAD=0 it calls `warn_if_unattached()` instead.

Top-level imports stay in the standard library, so importing this module on `import deepspeed`
costs next to nothing.
"""

from __future__ import annotations

import atexit
import functools
import logging
from types import MethodType, ModuleType
from typing import Any, Mapping

from perseus_ext.adapters.common import RankCounts, check_mode, check_rank_values, ensure_log_output, start_runtime

logger = logging.getLogger(__name__)

CONFIG_KEY = "perseus"

_schedule_classes: dict[str, type] = {}


def _classes() -> dict[str, type]:
    """DeepSpeed-derived classes, built on first use so importing this module stays cheap."""
    if _schedule_classes:
        return _schedule_classes
    from deepspeed.runtime.pipe import schedule as ds_schedule

    class PerseusForwardPass(ds_schedule.ForwardPass):
        """DeepSpeed's ForwardPass plus the microbatch it computes."""

        def __init__(self, buffer_id: int, micro_batch_id: int) -> None:
            super().__init__(buffer_id, micro_batch_id=micro_batch_id)

    class PerseusBackwardPass(ds_schedule.BackwardPass):
        """DeepSpeed's BackwardPass plus the microbatch it computes."""

        def __init__(self, buffer_id: int, micro_batch_id: int) -> None:
            super().__init__(buffer_id, micro_batch_id=micro_batch_id)

    class PerseusTrainSchedule(ds_schedule.TrainSchedule):
        """DeepSpeed's 1F1B TrainSchedule whose compute instructions name their microbatch.

        The instruction stream is otherwise identical (same buffers, same communication), so
        training does exactly the same math.
        """

        def steps(self):
            for step_id, commands in enumerate(super().steps()):
                micro_batch_id, _ = self._step_to_micro_batch(step_id)
                yield [self._tag(command, micro_batch_id) for command in commands]

        @staticmethod
        def _tag(command: Any, micro_batch_id: int) -> Any:
            if type(command) is ds_schedule.ForwardPass:
                return PerseusForwardPass(command.buffer_id, micro_batch_id)
            if type(command) is ds_schedule.BackwardPass:
                return PerseusBackwardPass(command.buffer_id, micro_batch_id)
            return command

    _schedule_classes.update(
        forward=PerseusForwardPass, backward=PerseusBackwardPass, train=PerseusTrainSchedule,
    )
    return _schedule_classes


NO_PIPELINE_FIX = (f"build the model as a deepspeed.pipe.PipelineModule, or set {CONFIG_KEY}.mode 'observe' "
                   f"or {CONFIG_KEY}.policy {{\"type\": \"zeus\", \"mode\": \"power_limit\"}}")


def attach(engine: Any, config: Any, *, prepared_run: Any = None) -> Any:
    """Hook a DeepSpeed engine instance; returns its `PerseusRuntime` (also `engine.perseus`).

    config: the `PerseusConfig` parsed at the door (a `"perseus"` dict is parsed here, for
    scripts that attach by hand). `prepared_run`: this run's batch size from the store
    (`with_run_batch_size`). A `PipelineEngine` gets every mode; any other engine (no pipeline:
    nothing to plan per stage) gets observe and power-limit modes, hooked at its
    forward/backward/step calls.
    """
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from perseus_ext.runtime import PerseusConfig

    if not isinstance(config, PerseusConfig):
        config = PerseusConfig.from_dict(config)
        check_rank_values(config, RankCounts.from_env())
    if getattr(engine, "perseus", None) is not None:
        return engine.perseus
    pipeline = isinstance(engine, PipelineEngine)
    check_mode(config, has_pipeline=pipeline, without_pipeline=f"this {type(engine).__name__} has no pipeline",
               fix=NO_PIPELINE_FIX)
    ensure_log_output()  # before the runtime: its first lines ("ready", the endpoint) must show
    if pipeline:
        runtime = _attach_pipeline(engine, config, prepared_run)
    else:
        runtime = _attach_engine(engine, config, prepared_run)
    engine.perseus = runtime
    original_destroy = getattr(engine, "destroy", None)
    if original_destroy is not None:
        @functools.wraps(original_destroy)
        def destroy(*args: Any, **kwargs: Any) -> Any:
            runtime.close()
            return original_destroy(*args, **kwargs)
        engine.destroy = destroy
    atexit.register(runtime.close)
    return runtime


def _one_f_one_b(stages: int, micro_batches: int) -> Any:
    from perseus_ext.planning.schedule import build_schedule

    return build_schedule("1f1b", stages, micro_batches)


def _sinks(engine: Any) -> tuple[Any, list[Any]]:
    """DeepSpeed's monitor, stepped by samples like DeepSpeed's own scalars (the runtime's
    metrics also go to Prometheus when configured; the last records are written at close)."""
    from perseus_ext.observability.monitoring import SampleCounts, deepspeed_sink

    samples = SampleCounts(engine.train_batch_size)
    return samples, [deepspeed_sink(getattr(engine, "monitor", None), samples)]


def _attach_pipeline(engine: Any, config: Any, prepared_run: Any) -> Any:
    """Tagged TrainSchedule, per-instance instruction map; `set_train_batch_size` re-plans,
    `set_train_micro_batch_size` re-profiles (both seen at the next `train_batch`)."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    from perseus_ext.planning.schedule import Kind

    grid = engine.grid
    samples, sinks = _sinks(engine)
    runtime, metrics = start_runtime(
        config,
        schedule=_one_f_one_b(engine.num_stages, engine.micro_batches),
        stage=engine.stage_id,
        sinks=sinks,
        dp_group=grid.get_data_parallel_group(),
        pp_group=grid.get_pipe_parallel_group(),
        local_rank=max(int(getattr(engine, "local_rank", 0) or 0), 0),
        prepared_run=prepared_run,
    )
    classes = _classes()
    stock = type(engine)._INSTRUCTION_MAP

    def computation(kind: Kind, handler: Any):
        def run(self: Any, buffer_id: int, micro_batch_id: int) -> None:
            runtime.before_computation(kind, micro_batch_id)
            handler(self, buffer_id=buffer_id)
            runtime.after_computation(kind, micro_batch_id)
        return run

    def compute_end(handler: Any):
        def run(self: Any, **kwargs: Any) -> None:
            runtime.mark_compute_end()
            handler(self, **kwargs)
        return run

    instruction_map = dict(stock)
    instruction_map[classes["forward"]] = computation(Kind.FORWARD, stock[ds_schedule.ForwardPass])
    instruction_map[classes["backward"]] = computation(Kind.BACKWARD, stock[ds_schedule.BackwardPass])
    for blocking in (ds_schedule.ReduceTiedGrads, ds_schedule.ReduceGrads):
        instruction_map[blocking] = compute_end(stock[blocking])
    engine._INSTRUCTION_MAP = instruction_map

    original_exec_schedule = engine._exec_schedule
    profiled_micro_batch = {"size": engine.train_micro_batch_size_per_gpu()}

    def exec_schedule(self: Any, pipe_schedule: Any) -> None:
        if type(pipe_schedule) is not ds_schedule.TrainSchedule:
            return original_exec_schedule(pipe_schedule)  # evaluation runs untouched
        size = self.train_micro_batch_size_per_gpu()
        if size != profiled_micro_batch["size"]:
            # set_train_micro_batch_size(): every computation's work changed, the profile is stale
            runtime.reprofile(f"train_micro_batch_size_per_gpu {profiled_micro_batch['size']} -> {size}")
            profiled_micro_batch["size"] = size
        if pipe_schedule.micro_batches != runtime.schedule.num_microbatches:
            # set_train_batch_size(): every rank changes it between the same two batches
            runtime.reschedule(_one_f_one_b(pipe_schedule.stages, pipe_schedule.micro_batches))
        tagged = classes["train"](
            micro_batches=pipe_schedule.micro_batches, stages=pipe_schedule.stages,
            stage_id=pipe_schedule.stage_id,
        )
        iteration = runtime.iteration
        runtime.iteration_start()
        original_exec_schedule(tagged)
        runtime.iteration_end()
        samples.record(iteration, self.global_samples)  # the OptimizerStep ran inside
        metrics.write()

    engine._exec_schedule = MethodType(exec_schedule, engine)
    return runtime


def _attach_engine(engine: Any, config: Any, prepared_run: Any) -> Any:
    """A non-pipeline engine: one iteration = `gradient_accumulation_steps()` forward/backward
    pairs up to the optimizer step at the accumulation boundary. Forwards outside training
    (eval mode or no_grad) pass through untouched."""
    import torch

    from perseus_ext.planning.schedule import Kind

    samples, sinks = _sinks(engine)
    runtime, metrics = start_runtime(
        config,
        schedule=_one_f_one_b(1, engine.gradient_accumulation_steps()),
        stage=0,
        sinks=sinks,
        dp_group=getattr(engine, "data_parallel_group", None),
        local_rank=max(int(getattr(engine, "local_rank", 0) or 0), 0),
        prepared_run=prepared_run,
    )
    state = {"forwards": 0, "backwards": 0, "in_iteration": False}
    original_forward, original_backward, original_step = engine.forward, engine.backward, engine.step

    def hooked(kind: Kind, counter: str, call: Any, args: tuple, kwargs: dict) -> Any:
        """One forward or backward between the runtime's hooks; `counter` numbers its microbatch."""
        microbatch = state[counter]
        state[counter] += 1
        runtime.before_computation(kind, microbatch)
        result = call(*args, **kwargs)
        runtime.after_computation(kind, microbatch)
        return result

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not engine.training or not torch.is_grad_enabled():
            return original_forward(*args, **kwargs)
        if not state["in_iteration"]:
            micro_batches = engine.gradient_accumulation_steps()
            if micro_batches != runtime.schedule.num_microbatches:  # set_train_batch_size()
                runtime.reschedule(_one_f_one_b(1, micro_batches))
            state.update(forwards=0, backwards=0, in_iteration=True)
            runtime.iteration_start()
        return hooked(Kind.FORWARD, "forwards", original_forward, args, kwargs)

    @functools.wraps(original_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if not state["in_iteration"]:
            return original_backward(*args, **kwargs)
        return hooked(Kind.BACKWARD, "backwards", original_backward, args, kwargs)

    @functools.wraps(original_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = state["in_iteration"] and engine.is_gradient_accumulation_boundary()
        iteration = runtime.iteration
        result = original_step(*args, **kwargs)
        if boundary:
            state["in_iteration"] = False
            runtime.iteration_end()
            samples.record(iteration, engine.global_samples)
            metrics.write()
        return result

    engine.forward, engine.backward, engine.step = forward, backward, step
    return runtime


def install(deepspeed_module: ModuleType | None = None) -> None:
    """Make `deepspeed.initialize` parse the config's `"perseus"` section before DeepSpeed builds
    anything and attach perseus-ext to the engine when the section is enabled; idempotent. With
    `perseus.policy.batch_size`, the run's batch size comes from the store before the engine is
    built (`with_run_batch_size`)."""
    if deepspeed_module is None:
        import deepspeed as deepspeed_module
    deepspeed_module._perseus_installed = True  # silences warn_if_unattached's wrapper
    original = deepspeed_module.initialize
    if getattr(original, "_perseus_wrapped", False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        settings = config_at_the_door(args, kwargs)  # before DeepSpeed builds anything
        prepared_run = None
        if settings is not None and settings.enabled:
            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            check_mode(settings, has_pipeline=_is_pipeline_module(model),
                       without_pipeline=f"the model ({type(model).__name__}) is not a pipeline", fix=NO_PIPELINE_FIX)
            args, kwargs, prepared_run = with_run_batch_size(args, kwargs, settings)
        result = original(*args, **kwargs)
        if settings is not None and settings.enabled:
            attach(result[0], settings, prepared_run=prepared_run)
        return result

    initialize._perseus_wrapped = True  # type: ignore[attr-defined]
    deepspeed_module.initialize = initialize


def _is_pipeline_module(model: Any) -> bool:
    """Whether DeepSpeed will build a PipelineEngine for `model`."""
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # a stand-in DeepSpeed (tests): the engine decides at attach()
        return True
    return isinstance(model, PipelineModule)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _read_ds_config(config: Any) -> dict | None:
    """The DeepSpeed config as a dict, read the way DeepSpeed reads it (a dict, a JSON file, or a
    base64-encoded JSON string); None when it cannot be read (DeepSpeed reports that itself)."""
    import json
    from pathlib import Path

    if isinstance(config, Mapping):
        return dict(config)
    if not (isinstance(config, (str, bytes)) or hasattr(config, "__fspath__")):
        return None
    try:
        return json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    if isinstance(config, str):
        import base64
        import binascii

        try:
            data = json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
        except (ValueError, binascii.Error):
            return None
        return data if isinstance(data, dict) else None
    return None


def _given_config(args: tuple, kwargs: dict) -> tuple[dict | None, bool]:
    """(the DeepSpeed config given to `deepspeed.initialize`, whether it came from
    `args.deepspeed_config`)."""
    ds_args = kwargs.get("args", args[0] if args else None)
    source = kwargs.get("config", kwargs.get("config_params"))
    from_args = source is None and getattr(ds_args, "deepspeed_config", None) is not None
    return _read_ds_config(ds_args.deepspeed_config if from_args else source), from_args


def config_at_the_door(args: tuple, kwargs: dict) -> Any:
    """The `"perseus"` section of the config given to `deepspeed.initialize`, parsed once into a
    `PerseusConfig` (a disabled section is validated too), or None without a section. Raises
    ConfigError naming the key before DeepSpeed builds anything."""
    config, _ = _given_config(args, kwargs)
    section = config.get(CONFIG_KEY) if config is not None else None
    if section is None:
        return None
    from perseus_ext.errors import ConfigError
    from perseus_ext.runtime import PerseusConfig

    if not isinstance(section, Mapping):
        raise ConfigError(f"{CONFIG_KEY} must be an object of settings, got {section!r}")
    config = PerseusConfig.from_dict(section)
    check_rank_values(config, RankCounts.from_env())  # every rank refuses what one rank would
    return config


def batch_keys_for(config: Mapping[str, Any], batch_size: int, data_parallel: int) -> tuple[dict, str]:
    """The DeepSpeed batch keys for a global batch size: the micro batch per GPU is kept (it is
    what fits in memory) and gradient accumulation changes, so global = micro x GAS x DP holds.
    Returns the new keys and a line saying what changed; ConfigError when it cannot hold."""
    from perseus_ext.errors import ConfigError

    where = f"{CONFIG_KEY}.policy.batch_size"
    total, micro, gas = (config.get(key) for key in BATCH_KEYS)
    if micro is None and total is not None and gas is not None and total % (gas * data_parallel) == 0:
        micro = total // (gas * data_parallel)
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ConfigError(f"{where} changes gradient_accumulation_steps and keeps the micro batch: set "
                          f"train_micro_batch_size_per_gpu in the DeepSpeed config (got {micro!r})")
    per_step = micro * data_parallel
    if batch_size % per_step:
        raise ConfigError(f"{where}: batch size {batch_size} is not a multiple of train_micro_batch_size_per_gpu "
                          f"{micro} x data-parallel size {data_parallel} = {per_step}; list batch_sizes that "
                          f"are multiples of {per_step}")
    keys = {"train_batch_size": batch_size, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": batch_size // per_step}
    change = (f"gradient_accumulation_steps {gas if gas is not None else 'unset'} -> {keys['gradient_accumulation_steps']} "
              f"(train_micro_batch_size_per_gpu {micro} x data-parallel {data_parallel} kept), "
              f"train_batch_size {total if total is not None else 'unset'} -> {batch_size}")
    return keys, change


def _data_parallel_layout(model: Any, mpu: Any, kwargs: dict) -> tuple[int, int]:
    """(data-parallel size, GPUs of the job) before the engine exists: a PipelineModule's
    topology, else the world over the model-parallel size as DeepSpeed computes it (starting
    torch.distributed the way `deepspeed.initialize` would, if the script has not)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    topology = getattr(model, "_topo", None)
    if topology is not None:
        return topology.get_dim("data"), topology.world_size()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               dist_init_required=kwargs.get("dist_init_required"),
                               **({"distributed_port": kwargs["distributed_port"]} if "distributed_port" in kwargs else {}))
    world = deepspeed.comm.get_world_size()
    model_parallel = mpu.get_model_parallel_world_size() if mpu is not None else 1
    return max(world // model_parallel, 1), world


def with_run_batch_size(args: tuple, kwargs: dict, settings: Any) -> tuple[tuple, dict, Any]:
    """`deepspeed.initialize`'s arguments with this run's batch size from the store, and the
    prepared run to hand to the runtime, when `settings` (the door's `PerseusConfig`) enables
    `policy.batch_size`; (args, kwargs, None) unchanged otherwise. Every rank calls it; rank 0
    asks the store and broadcasts. Every candidate is checked against the micro batch and the
    data-parallel size first, so a bad list fails on the first run, not the n-th."""
    kwargs = dict(kwargs)
    if settings is None or not settings.enabled or settings.policy is None or settings.policy.batch_size is None:
        return args, kwargs, None
    import os

    from perseus_ext.runtime.recurring import choose_batch_size

    config, from_args = _given_config(args, kwargs)
    ds_args = kwargs.get("args", args[0] if args else None)
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    data_parallel, num_gpus = _data_parallel_layout(model, kwargs.get("mpu"), kwargs)
    for candidate in settings.policy.batch_size.batch_sizes:
        batch_keys_for(config, candidate, data_parallel)
    prepared = choose_batch_size(settings, num_gpus=num_gpus,
                                 local_rank=max(int(os.environ.get("LOCAL_RANK", "0")), 0))
    assignment = prepared.assignment
    keys, change = batch_keys_for(config, assignment.batch_size, data_parallel)
    config.update(keys)
    ensure_log_output()
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("perseus-ext: run %d of job %r trains with batch size %d (%s): %s", assignment.run_id,
                    assignment.job_id, assignment.batch_size, assignment.phase, change)
    kwargs.pop("config_params", None)
    kwargs["config"] = config
    if from_args:
        import copy

        ds_args = copy.copy(ds_args)
        ds_args.deepspeed_config = None  # DeepSpeed refuses a config given twice
        if "args" in kwargs or not args:
            kwargs["args"] = ds_args
        else:
            args = (ds_args, *args[1:])
    return args, kwargs, prepared


def warn_if_unattached(deepspeed_module: ModuleType) -> None:
    """Make `deepspeed.initialize` warn when its config enables `"perseus"` but `install()` was
    never called (autoload off): DeepSpeed ignores unknown config keys without a word, and it
    offers no plugin hook that would let perseus-ext notice otherwise."""
    original = deepspeed_module.initialize
    if getattr(original, "_perseus_wrapped", False) or getattr(original, "_perseus_watched", False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        config, _ = _given_config(args, kwargs)
        result = original(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) and result else result
        section = config.get(CONFIG_KEY) if config is not None else None
        enabled = isinstance(section, Mapping) and section.get("enabled") is True  # perseus is off: no validation
        if (enabled and not getattr(deepspeed_module, "_perseus_installed", False)
                and getattr(engine, "perseus", None) is None):
            logger.warning(
                "perseus-ext: the DeepSpeed config enables \"%s\" but perseus-ext is not attached "
                "(PERSEUS_AUTOLOAD=0 turned the automatic hook off): call "
                "perseus_ext.adapters.deepspeed.install() before deepspeed.initialize, or unset "
                "PERSEUS_AUTOLOAD", CONFIG_KEY,
            )
        return result

    initialize._perseus_watched = True  # type: ignore[attr-defined]
    deepspeed_module.initialize = initialize

