"""DeepSpeed pipeline-engine adapter: a `"perseus"` section in the DeepSpeed config is all it takes.

How it hooks the stock `PipelineEngine` that `deepspeed.initialize` builds, without forking
DeepSpeed:

* `install()` wraps `deepspeed.initialize`; when the returned engine is a `PipelineEngine` and the
  config's `"perseus"` section is enabled, `attach()` validates the section (ConfigError naming the
  key) and hooks that engine instance.
* `attach()` gives the instance its own `_INSTRUCTION_MAP` (the engine looks the map up through
  `self`, so the class and other engines are untouched) and wraps its `_exec_schedule`: a
  `TrainSchedule` is swapped for `PerseusTrainSchedule`, which emits the same instructions but
  with forward/backward instructions that carry their microbatch id. Their handlers tell the
  runtime which computation runs next (a device marker recorded and the next clock queued on
  it, never a CUDA synchronize), then run DeepSpeed's own handler. `ReduceTiedGrads`/`ReduceGrads`
  mark the end of the pipeline's own compute (straggler detection must not count the
  data-parallel wait).
* `autoload()` arranges for `install()` to run as soon as `deepspeed` is imported, for a `.pth`
  file, so user scripts need no perseus import at all.

Top-level imports stay in the standard library so `autoload()` costs nothing at start-up.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from types import MethodType, ModuleType
from typing import Any, Mapping

logger = logging.getLogger(__name__)

CONFIG_KEY = "perseus"
AUTOLOAD_ENV = "PERSEUS_AUTOLOAD"  # set to 0 to keep autoload() from hooking deepspeed

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


def perseus_section(engine: Any) -> Mapping[str, Any] | None:
    """The `"perseus"` section of the config the engine was built from (dict, file or args)."""
    params = getattr(getattr(engine, "_config", None), "_param_dict", None) or {}
    return params.get(CONFIG_KEY)


def attach(engine: Any, config: Any = None) -> Any:
    """Hook a `PipelineEngine` instance; returns its `PerseusRuntime` (also `engine.perseus`).

    config: a PerseusConfig, a `"perseus"` dict, or None to read the engine's DeepSpeed config.
    """
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from perseus_ext.errors import ConfigError
    from perseus_ext.planning.schedule import Kind, build_schedule
    from perseus_ext.runtime import PerseusConfig, PerseusRuntime

    if not isinstance(config, PerseusConfig):
        config = PerseusConfig.from_dict(config if config is not None else perseus_section(engine))
    if not isinstance(engine, PipelineEngine):
        raise ConfigError(
            f"{CONFIG_KEY}: perseus-ext plans pipeline schedules; build the model as a "
            f"deepspeed.pipe.PipelineModule (got a {type(engine).__name__})"
        )
    if getattr(engine, "perseus", None) is not None:
        return engine.perseus
    grid = engine.grid
    runtime = PerseusRuntime(
        config,
        schedule=build_schedule("1f1b", engine.num_stages, engine.micro_batches),
        stage=engine.stage_id,
        dp_group=grid.get_data_parallel_group(),
        pp_group=grid.get_pipe_parallel_group(),
        local_rank=max(int(getattr(engine, "local_rank", 0) or 0), 0),
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

    def exec_schedule(self: Any, pipe_schedule: Any) -> None:
        if type(pipe_schedule) is not ds_schedule.TrainSchedule:
            return original_exec_schedule(pipe_schedule)  # evaluation runs untouched
        tagged = classes["train"](
            micro_batches=pipe_schedule.micro_batches, stages=pipe_schedule.stages,
            stage_id=pipe_schedule.stage_id,
        )
        runtime.iteration_start()
        original_exec_schedule(tagged)
        runtime.iteration_end()

    engine._exec_schedule = MethodType(exec_schedule, engine)
    engine.perseus = runtime
    _ensure_log_output()
    original_destroy = getattr(engine, "destroy", None)
    if original_destroy is not None:
        @functools.wraps(original_destroy)
        def destroy(*args: Any, **kwargs: Any) -> Any:
            runtime.close()
            return original_destroy(*args, **kwargs)
        engine.destroy = destroy
    atexit.register(runtime.close)
    return runtime


def _ensure_log_output() -> None:
    """Show perseus-ext's INFO lines when the training script configured no logging at all
    (DeepSpeed scripts usually do not), so the per-iteration log and summary are visible."""
    package_logger = logging.getLogger("perseus_ext")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


def install(deepspeed_module: ModuleType | None = None) -> None:
    """Make `deepspeed.initialize` attach perseus-ext to pipeline engines whose config has an
    enabled `"perseus"` section; idempotent."""
    if deepspeed_module is None:
        import deepspeed as deepspeed_module
    original = deepspeed_module.initialize
    if getattr(original, "_perseus_wrapped", False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        engine = result[0]
        section = perseus_section(engine)
        if section is not None and not isinstance(section, Mapping):
            from perseus_ext.errors import ConfigError

            raise ConfigError(f"{CONFIG_KEY} must be an object of settings, got {section!r}")
        if section and section.get("enabled") is True:
            attach(engine, section)
        elif section:
            from perseus_ext.runtime import PerseusConfig

            PerseusConfig.from_dict(section)  # a disabled section must still be valid
        return result

    initialize._perseus_wrapped = True  # type: ignore[attr-defined]
    deepspeed_module.initialize = initialize


class _HookDeepSpeedImport(importlib.abc.MetaPathFinder):
    """Runs `install()` right after `deepspeed` is imported (whoever imports it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # find the real package with the remaining finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module: ModuleType) -> None:
            exec_module(module)
            try:
                install(module)
            except Exception as err:  # a broken hook must never break `import deepspeed`
                logger.error("perseus-ext: could not hook deepspeed.initialize: %r", err)

        spec.loader.exec_module = exec_and_install  # type: ignore[method-assign]
        return spec


def autoload() -> None:
    """Hook DeepSpeed on import, for a `.pth` line (`import perseus_ext.adapters.deepspeed as m;
    m.autoload()`); set PERSEUS_AUTOLOAD=0 to opt out."""
    if os.environ.get(AUTOLOAD_ENV, "1") == "0":
        return
    if "deepspeed" in sys.modules:
        install(sys.modules["deepspeed"])
    elif not any(isinstance(f, _HookDeepSpeedImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _HookDeepSpeedImport())
