"""Megatron integration: `--perseus` flags and per-computation clocks in megatron-core's schedules.

The adapter is thin: all planning, profiling, clock control and straggler handling live in
`perseus_ext.runtime.PerseusRuntime` (shared with the DeepSpeed adapter). This module only

* adds the `--perseus*` argument group (usable as Megatron-LM's `extra_args_provider`);
* wraps megatron-core's `forward_backward_pipelining_without_interleaving` /
  `..._with_interleaving` (one training iteration) and the module-level `forward_step` /
  `backward_step` those schedules call, so every computation reports (kind, microbatch, chunk)
  to the runtime right before and after it runs;
* marks the end of the stage's computations (what follows is the data-parallel gradient sync,
  which straggler detection must not count). Communication needs no hook: the runtime orders
  clock changes by device markers at computation boundaries, which is where receives wait.

Why wrap module functions instead of subclassing: megatron-core's schedules are plain functions
that look `forward_step`/`backward_step` up in their module at call time, and their signatures
change between releases. The wrappers bind arguments by *name* with `inspect.signature`, so they
only rely on a few long-lived parameter names (`model`, `output_tensor`, `num_microbatches`),
and they identify computations from the schedule's own objects: the chunk is the position of the
`model` argument in the iteration's model list, the microbatch is the running forward count of
that chunk, and a backward is matched to its forward through the identity of the output tensor
the schedule hands back. Nothing is synchronised on the device.

The plan lists each stage's computations in the order `perseus_ext.planning.schedule` predicts
(the interleaved order is built with megatron's own `microbatch_group_size_per_vp_stage`). The
runtime checks every reported computation against that order; on the first mismatch (a
megatron-core version that reorders work, an unsupported schedule option such as the combined
1F1B MoE path, ...) it logs one error naming both computations and runs that rank at default
clocks from then on, still joining the runtime's collectives. Training is never interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from perseus_ext.adapters.megatron_args import add_perseus_args, chain_extra_args, config_from_args
from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import (
    Kind,
    PipelineSchedule,
    build_schedule,
    interleaved,
)

log = logging.getLogger("perseus_ext.megatron")
__all__ = ["MegatronPerseus", "add_perseus_args", "chain_extra_args", "config_from_args", "install"]

_SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
_WITHOUT_INTERLEAVING = "forward_backward_pipelining_without_interleaving"
_WITH_INTERLEAVING = "forward_backward_pipelining_with_interleaving"


# --------------------------------------------------------------------------------------------
# Schedule observation
# --------------------------------------------------------------------------------------------


def _first_tensor(value: Any) -> Any:
    """Megatron passes single tensors or one-element lists depending on the version/path."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


def _microbatch_group_size(model: Any) -> int | None:
    """megatron-core's `microbatch_group_size_per_vp_stage` (None: its default, the PP size)."""
    from megatron.core.utils import get_model_config

    value = getattr(get_model_config(model), "microbatch_group_size_per_vp_stage", None)
    return value if isinstance(value, int) else None


@dataclasses.dataclass
class _Iteration:
    """Book-keeping for one training iteration on this stage."""

    models: list[Any]
    num_computations: int
    forwards_per_chunk: list[int]
    observed: int = 0
    pending_backward: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def chunk_of(self, model: Any, vp_stage: Any) -> int | None:
        for index, candidate in enumerate(self.models):
            if candidate is model:
                return index
        return vp_stage if isinstance(vp_stage, int) else None


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
    ) -> None:
        self._args = args
        self._gpu = gpu
        self._policy = policy
        self._config: Any = None
        self.runtime: Any = None
        self.schedule: PipelineSchedule | None = None
        self.stage: int | None = None
        self._iteration: _Iteration | None = None
        self._unidentified: str | None = None
        self._originals: dict[str, Callable] = {}
        self._closed = False

    # ---- installation ------------------------------------------------------------------

    def _patch(self) -> None:
        module = importlib.import_module(_SCHEDULES_MODULE)
        wrappers = {
            "forward_step": self._wrap_step(module.forward_step, Kind.FORWARD),
            "backward_step": self._wrap_step(module.backward_step, Kind.BACKWARD),
            _WITHOUT_INTERLEAVING: self._wrap_schedule(getattr(module, _WITHOUT_INTERLEAVING)),
            _WITH_INTERLEAVING: self._wrap_schedule(getattr(module, _WITH_INTERLEAVING)),
        }
        for name, wrapper in wrappers.items():
            self._originals[name] = getattr(module, name)
            setattr(module, name, wrapper)

    def _unpatch(self) -> None:
        module = importlib.import_module(_SCHEDULES_MODULE)
        for name, original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    # ---- wrappers --------------------------------------------------------------------------

    def _wrap_schedule(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run_iteration(*args: Any, **kwargs: Any) -> Any:
            if self._iteration is not None or self._closed:  # nested call / uninstalled
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            if bound.get("forward_only") or not self._start_iteration(bound, original):
                return original(*args, **kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                # Training is failing anyway; skipping iteration_end (which may run collectives
                # with ranks that are not coming) lets the error surface instead of a hang.
                self._iteration = None
                raise
            self._iteration = None
            self.runtime.iteration_end()
            return result

        return run_iteration

    def _wrap_step(self, original: Callable, kind: Kind) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run_step(*args: Any, **kwargs: Any) -> Any:
            iteration = self._iteration
            if iteration is None:
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            identity = self._identify(iteration, kind, bound)
            if identity is None:  # the runtime fell back: default clocks for this rank
                return original(*args, **kwargs)
            microbatch, chunk = identity
            self.runtime.before_computation(kind, microbatch, chunk=chunk)
            result = original(*args, **kwargs)
            if kind is Kind.FORWARD:
                output = _first_tensor(result[0] if isinstance(result, tuple) else result)
                iteration.pending_backward[id(output)] = identity
            self.runtime.after_computation(kind, microbatch, chunk=chunk)
            iteration.observed += 1
            if iteration.observed == iteration.num_computations:
                self.runtime.mark_compute_end()  # what follows is the data-parallel grad sync
            return result

        return run_step

    def _identify(self, iteration: _Iteration, kind: Kind, bound: dict) -> tuple[int, int] | None:
        """(microbatch, chunk) of the computation megatron is about to run.

        The runtime checks it against the plan's order and falls back to default clocks (one
        error, training goes on) when megatron runs something else.
        """
        if kind is Kind.FORWARD:
            chunk = iteration.chunk_of(bound.get("model"), bound.get("vp_stage"))
            if chunk is None or not 0 <= chunk < len(iteration.forwards_per_chunk):
                return self._cannot_identify("a forward step of a model chunk it was not given")
            reported = bound.get("current_microbatch")
            counted = iteration.forwards_per_chunk[chunk]
            iteration.forwards_per_chunk[chunk] += 1
            return (reported if isinstance(reported, int) else counted), chunk
        output = _first_tensor(bound.get("output_tensor"))
        identity = iteration.pending_backward.pop(id(output), None)
        if identity is None:
            return self._cannot_identify("a backward step of an output no observed forward made")
        return identity

    def _cannot_identify(self, what: str) -> None:
        if self._unidentified is None:
            self._unidentified = what
            self.runtime.fall_back(f"megatron-core ran {what}, which perseus cannot place in the plan")
        return None

    def _start_iteration(self, bound: dict, original: Callable) -> bool:
        models = bound.get("model")
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        if self.runtime is None and not self._build_runtime(bound, original, models):
            return False
        assert self.schedule is not None and self.stage is not None
        self._iteration = _Iteration(
            models=models,
            num_computations=len(self.schedule.orders[self.stage]),
            forwards_per_chunk=[0] * len(models),
        )
        self.runtime.iteration_start()
        return True

    # ---- runtime --------------------------------------------------------------------------

    def _megatron_args(self) -> argparse.Namespace:
        if self._args is None:
            from megatron.training import get_args

            self._args = get_args()
        return self._args

    @staticmethod
    def _pp_group(bound: dict) -> Any:
        collection = bound.get("pg_collection")
        if collection is not None and getattr(collection, "pp", None) is not None:
            return collection.pp
        communicator = bound.get("p2p_communicator")
        if communicator is not None and getattr(communicator, "pp_group", None) is not None:
            return communicator.pp_group
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_group()

    @staticmethod
    def _dp_group() -> Any:
        """Straggler detection compares the pipelines of Megatron's data-parallel group."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @staticmethod
    def _local_device() -> int:
        """The CUDA ordinal this process drives (NVML maps it through CUDA_VISIBLE_DEVICES)."""
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def _build_runtime(self, bound: dict, original: Callable, models: list[Any]) -> bool:
        """First training iteration: build the schedule this stage runs and the runtime."""
        if self._config is None:
            self._config = config_from_args(self._megatron_args())
        if self._config is None:  # --perseus not given: stay out of the way for good
            self._closed = True
            self._unpatch()
            return False
        num_microbatches = bound.get("num_microbatches")
        if not isinstance(num_microbatches, int):
            raise ConfigError("perseus: megatron-core's schedule was called without an integer "
                              "num_microbatches; pass it by keyword as megatron-core documents")
        pp_group = self._pp_group(bound)
        self.stage, num_stages = pp_group.rank(), pp_group.size()
        if original.__name__ == _WITH_INTERLEAVING:
            self.schedule = interleaved(
                num_stages, num_microbatches, len(models), _microbatch_group_size(models[0])
            )
        else:
            self.schedule = build_schedule("1f1b", num_stages, num_microbatches)
        from perseus_ext.runtime import PerseusRuntime

        self.runtime = PerseusRuntime(
            self._config,
            schedule=self.schedule,
            stage=self.stage,
            dp_group=self._dp_group(),
            pp_group=pp_group,
            gpu=self._gpu,
            policy=self._policy,
            local_rank=self._local_device(),
        )
        log.info("perseus: stage %d of %s", self.stage, self.schedule.describe())
        return True

    # ---- public ---------------------------------------------------------------------------

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
        if self.runtime is not None:
            self.runtime.close()
        return self.summary()


def install(
    args: argparse.Namespace | None = None,
    *,
    gpu: Any = None,
    policy: Any = None,
) -> MegatronPerseus | None:
    """One call from a pretraining script: hook megatron-core's pipeline schedules.

    `args` are the parsed arguments carrying the `--perseus*` flags; None means "Megatron-LM's
    global args" (`megatron.training.get_args()`), read at the first training iteration, so the
    call can come before `pretrain()` parses the command line. Returns None when `args` are
    given and `--perseus` is off. One install per process at a time; `close()` undoes it.
    """
    global _INSTALLED
    if args is not None and not getattr(args, "perseus", False):
        return None
    if _INSTALLED is not None and not _INSTALLED._closed:
        raise ConfigError("perseus is already installed on megatron-core in this process; "
                          "close() the previous install first")
    perseus = MegatronPerseus(args, gpu=gpu, policy=policy)
    if args is not None:
        perseus._config = config_from_args(args)  # bad flags fail before training starts
    perseus._patch()
    atexit.register(perseus.close)
    _INSTALLED = perseus
    return perseus


_INSTALLED: MegatronPerseus | None = None
