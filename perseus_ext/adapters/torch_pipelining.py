"""torch.distributed.pipelining adapter: `enable(schedule, config)` is all it takes.

How it hooks a stock schedule object without re-implementing any schedule:

* `enable()` parses the `"perseus"` section into a `PerseusConfig` at once (ConfigError naming
  the key, before the first step) and refuses a schedule class it does not support
  (ConfigError naming the class).
* The instance's `step` is wrapped (one call = one training iteration), and so are the entry
  points every schedule class calls on its local `PipelineStage`s: `forward_one_chunk`,
  `backward_one_chunk` (a full backward, or with `full_backward=False` the input gradient),
  `backward_weight_one_chunk` (the weight gradient) and `perform_reduce_grad` (the gradient
  sync). DualPipeV's overlapped action runs its two parts one after the other through these
  same methods, and is recorded as the two actions it runs.
* The first step runs untouched (default clocks; torch infers shapes there) while the adapter
  records the actions each rank executes. The ranks of the pipeline gather their records, build
  the schedule (`planning.schedule.schedule_from_actions`, every dependency rule checked) from
  them and, where `pipeline_order` is what the schedule executes, compare the two: a
  difference is a ConfigError on every rank, never a plan for a schedule that is not running.
* When every action is one the runtime profiles and paces (forward, full backward, input
  gradient, weight gradient and gradient sync: every kind the supported classes run), the
  runtime starts (`adapters.common.start_runtime`) on the whole graph, gradient syncs included,
  and the hooks drive it from then on: profiling (a row per kind, the sync's own), solving,
  deployment of per-action clocks, straggler detection across the data-parallel replicas given
  as `dp_group`. A gradient sync is an action like the others: the FSDP post-backward it runs
  (the data-parallel reduce) and the gradient scaling take a planned clock. Its compute ends
  after the last gradient sync of a rank's stages. Otherwise (a kind the runtime has no profile
  row for) the job keeps default clocks, said in one log line.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from perseus_ext.adapters.common import check_mode, ensure_log_output, start_runtime
from perseus_ext.adapters.torch_pipelining_actions import (
    RUNTIME_KINDS,
    RankLayout,
    first_mismatch,
    is_authoritative,
    local_stages,
    orders_from_pipeline_order,
    supported_kind,
)
from perseus_ext.errors import ConfigError, ScheduleError
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule, schedule_from_actions

logger = logging.getLogger(__name__)

CONFIG_KEY = "perseus"
_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad")


def _forward_kind(args: tuple, kwargs: dict) -> Kind:
    return Kind.FORWARD


def _backward_kind(args: tuple, kwargs: dict) -> Kind:
    """`backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)`: a full backward,
    or the input gradient alone when `full_backward` is False (zero-bubble schedules)."""
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return Kind.BACKWARD if full else Kind.INPUT_GRADIENT


def _weight_kind(args: tuple, kwargs: dict) -> Kind:
    return Kind.WEIGHT_GRADIENT


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def read_config(config: Any) -> Any:
    """A `PerseusConfig` from what `enable` accepts: one already parsed, the `"perseus"` section
    as a mapping, or a JSON file whose top-level object holds a `"perseus"` section."""
    from perseus_ext.config import PerseusConfig

    if isinstance(config, PerseusConfig):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read the perseus-ext config file {str(path)!r}: {err}") from None
        if not isinstance(data, Mapping) or not isinstance(data.get(CONFIG_KEY), Mapping):
            raise ConfigError(f"{str(path)!r} must hold a JSON object with a {CONFIG_KEY!r} object of settings")
        config = data[CONFIG_KEY]
    if not isinstance(config, Mapping):
        raise ConfigError(f"{CONFIG_KEY} must be an object of settings, got {type(config).__name__}")
    return PerseusConfig.from_dict(dict(config))


class TorchPipeliningPerseus:
    """perseus-ext on one rank's torch.distributed.pipelining schedule (`enable` builds it).

    `runtime`: the rank's `PerseusRuntime` from the second step on (None before, and for a
    schedule whose actions the runtime cannot plan); `graph`: every action the pipeline ran in
    its first step, gradient syncs included; `planned`: the schedule the runtime plans (the
    whole graph; None while nothing is planned); `coverage()`: which of this rank's actions,
    gradient syncs included, ran under the runtime's hooks in the last step.
    """

    def __init__(self, schedule: Any, config: Any, *, dp_group: Any = None, gpu: Any = None,
                 policy: Any = None, local_rank: int | None = None) -> None:
        self.config = read_config(config)
        self.kind = supported_kind(schedule)
        self.torch_schedule = schedule
        self.stages = local_stages(schedule)
        first = self.stages[0]
        self.num_stages = int(first.group_size)
        self.pp_group = getattr(first, "group", None)
        self.pp_rank = int(first.group_rank)
        self.dp_group, self._gpu, self._policy = dp_group, gpu, policy
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        check_mode(self.config, has_pipeline=self.num_stages > 1,
                   without_pipeline=f"this {type(schedule).__name__} has one pipeline stage",
                   fix=f"split the model over 2 or more ranks, or set {CONFIG_KEY}.mode 'observe'")
        self._chunk_of = {stage.stage_index: chunk for chunk, stage in enumerate(self.stages)}
        self.runtime: Any = None
        self.metrics: Any = None
        self.graph: PipelineSchedule | None = None
        self.planned: PipelineSchedule | None = None
        self.idle_reason: str | None = None
        self._recorded: list[Computation] = []
        self._in_step = False
        self._steps = 0
        self._syncs = 0
        self._hooked_actions = 0
        self._ran_actions = 0
        self._closed = False
        self._originals: list[tuple[Any, str, Any]] = []
        if self.config.enabled:
            self._hook()

    # ---------------------------------------------------------------- hooking
    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, functools.wraps(original)(make(original)))

    def _hook(self) -> None:
        self._wrap(self.torch_schedule, "step", self._step_wrapper)
        for stage in self.stages:
            chunk = self._chunk_of[stage.stage_index]
            self._wrap(stage, "forward_one_chunk", lambda f, c=chunk: self._action(f, c, _forward_kind))
            self._wrap(stage, "backward_one_chunk", lambda f, c=chunk: self._action(f, c, _backward_kind))
            self._wrap(stage, "backward_weight_one_chunk", lambda f, c=chunk: self._action(f, c, _weight_kind))
            self._wrap(stage, "perform_reduce_grad", lambda f, c=chunk: self._reduce_grad(f, c))

    def _step_wrapper(self, original: Any) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self._in_step or self._closed:
                return original(*args, **kwargs)
            runtime = self.runtime
            self._in_step, self._syncs = True, 0
            self._hooked_actions = self._ran_actions = 0
            self._recorded = []
            if runtime is not None:
                runtime.iteration_start()
            try:
                result = original(*args, **kwargs)
            finally:
                self._in_step = False
            if runtime is not None:
                runtime.iteration_end()
                self.metrics.write()
            elif self._steps == 0:
                self._after_first_step()
            self._steps += 1
            return result
        return step

    def _action(self, original: Any, chunk: int, kind_of: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:  # evaluation or a call outside a step: not an iteration's work
                return original(*args, **kwargs)
            microbatch = int(kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", args[0] if args else 0)))
            kind = kind_of(args, kwargs)
            computation = Computation(self.pp_rank, chunk, microbatch, kind)
            self._ran_actions += 1
            if self.runtime is None:
                self._recorded.append(computation)
                return original(*args, **kwargs)
            self._hooked_actions += 1
            self.runtime.before_computation(kind, microbatch, chunk)
            result = original(*args, **kwargs)
            self.runtime.after_computation(kind, microbatch, chunk)
            return result
        return run

    def _reduce_grad(self, original: Any, chunk: int) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return original(*args, **kwargs)
            self._ran_actions += 1
            self._syncs += 1
            runtime = self.runtime
            if runtime is None:
                self._recorded.append(Computation(self.pp_rank, chunk, 0, Kind.REDUCE_GRAD))
                return original(*args, **kwargs)
            self._hooked_actions += 1
            runtime.before_computation(Kind.REDUCE_GRAD, 0, chunk)
            result = original(*args, **kwargs)
            runtime.after_computation(Kind.REDUCE_GRAD, 0, chunk)
            if self._syncs == len(self.stages):
                runtime.mark_compute_end()  # every local stage's gradients are synced
            return result
        return run

    # ---------------------------------------------------------------- the first step
    def _gather(self, item: Any) -> list[Any]:
        import torch.distributed as dist

        if self.pp_group is None or not dist.is_initialized() or self.num_stages == 1:
            return [item]
        gathered: list[Any] = [None] * self.num_stages
        dist.all_gather_object(gathered, item, group=self.pp_group)
        return gathered

    def _after_first_step(self) -> None:
        """Gather every rank's executed actions, build and cross-check the graph, then start the
        runtime (or say in one line why this job keeps default clocks). Every rank of a pipeline
        reaches the same verdict from the same gathered records, so they raise together."""
        gathered = self._gather(([stage.stage_index for stage in self.stages], self._recorded))
        layout = RankLayout.from_indices([indices for indices, _ in gathered])
        executed = [list(order) for _, order in gathered]
        name = type(self.torch_schedule).__name__
        order = getattr(self.torch_schedule, "pipeline_order", None)
        if is_authoritative(self.torch_schedule) and order:
            listed = orders_from_pipeline_order(order, layout)
            mismatch = first_mismatch(executed, listed)
            if mismatch is not None:
                self.close()
                raise ConfigError(f"the {name} executed another order than its pipeline_order: {mismatch}; "
                                  f"perseus-ext plans only the order that runs (was pipeline_order changed "
                                  f"after the schedule was built?)")
        try:
            self.graph = schedule_from_actions(executed, layout.placement, self.kind)
        except ScheduleError as err:
            self.close()
            raise ConfigError(f"the actions the {name} executed do not form a pipeline iteration: {err}") from None
        kinds = {c.kind for ran in executed for c in ran}
        unplanned = sorted(k.value for k in kinds - RUNTIME_KINDS)
        if unplanned:
            self.idle_reason = (f"the {name} runs {', '.join(unplanned)} computations, which the runtime does not "
                                f"profile or pace; perseus-ext keeps the default GPU clocks for this job")
            if _global_rank() == 0:  # one line for the whole job
                ensure_log_output()
                logger.warning("perseus-ext: %s", self.idle_reason)
            return
        self.planned = self.graph
        self._start_runtime()

    def _start_runtime(self) -> None:
        ensure_log_output()
        self.runtime, self.metrics = start_runtime(
            self.config, schedule=self.planned, stage=self.pp_rank, sinks=[], dp_group=self.dp_group,
            pp_group=self.pp_group if self.num_stages > 1 else None, gpu=self._gpu, policy=self._policy,
            local_rank=self.local_rank,
        )
        atexit.register(self.close)

    # ---------------------------------------------------------------- public
    def coverage(self) -> tuple[int, int]:
        """(actions the runtime's hooks bracketed, actions that ran) in the last step."""
        return self._hooked_actions, self._ran_actions

    def summary(self) -> dict[str, Any]:
        """The runtime's per-rank summary plus what the adapter saw of the schedule."""
        summary = dict(self.runtime.summary()) if self.runtime is not None else {}
        hooked, ran = self.coverage()
        summary["torch_pipelining"] = {
            "schedule_class": type(self.torch_schedule).__name__, "stage": self.pp_rank,
            "graph": self.graph.describe() if self.graph is not None else None,
            "planned": self.planned.describe() if self.planned is not None else None,
            "gradient_syncs": sum(1 for order in (self.graph.orders if self.graph else ()) for c in order
                                  if c.kind is Kind.REDUCE_GRAD),
            "hooked_actions": hooked, "actions": ran, "idle_reason": self.idle_reason,
        }
        return summary

    def close(self) -> dict[str, Any]:
        """Restore the default clocks and the schedule's own methods; returns `summary()`.
        Idempotent, never raises."""
        if not self._closed:
            self._closed = True
            if self.runtime is not None:
                self.runtime.close()
            for owner, name, previous in reversed(self._originals):
                if previous is None:
                    owner.__dict__.pop(name, None)
                else:
                    setattr(owner, name, previous)
            self._originals.clear()
        return self.summary()


def enable(schedule: Any, config: Any, *, dp_group: Any = None, gpu: Any = None, policy: Any = None,
           local_rank: int | None = None) -> TorchPipeliningPerseus:
    """Enable perseus-ext on a torch.distributed.pipelining schedule object; call it on every
    rank after building the schedule and before its first `step()`.

    config: the `"perseus"` section (a mapping), a JSON file holding one, or a parsed
    `PerseusConfig`; validated here (ConfigError naming the key). `dp_group`: the
    data-parallel group whose replicas of this stage straggler detection compares (None: one
    pipeline). `gpu`/`policy`: test and power-user overrides, as for the other adapters.
    Returns the rank's handle; `close()` it (or let interpreter exit do so) to restore clocks.
    """
    return TorchPipeliningPerseus(schedule, config, dp_group=dp_group, gpu=gpu, policy=policy,
                                  local_rank=local_rank)
