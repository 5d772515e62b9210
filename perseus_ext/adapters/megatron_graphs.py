"""Which CUDA-graph mode and schedule variant a Megatron job runs, read from its arguments.

perseus-ext steers clocks from per-computation hooks in megatron-core's schedule, and some
execution modes change what those hooks see. Each supported megatron-core release (0.16 and
newer) spells them differently; the rules below were read from Megatron-LM's
`megatron/training/arguments.py`, `megatron/training/training.py`,
`megatron/core/full_cuda_graph.py` and `megatron/core/transformer/cuda_graph_config.py` at the
release branches core_r0.16.0 to core_r0.19.0:

* **Full-iteration CUDA graph** -- `FullCudaGraphWrapper` runs the schedule eagerly for
  `cuda_graph_warmup_steps` calls, captures the whole forward-backward once and from then on
  only calls `replay()`: no hook runs. 0.16/0.17: `--cuda-graph-impl local --cuda-graph-scope
  full_iteration` (or the deprecated `--enable-cuda-graph`, which validate_args turns into
  `local`). 0.18 and newer: `--cuda-graph-impl full_iteration`; the deprecated spelling
  `--cuda-graph-scope full_iteration` / `--cuda-graph-modules full_iteration` (with impl `none`
  or `local`) is migrated to it, so with impl `none` it captures from 0.18 on but not before.
* **Per-layer CUDA graphs** -- `--cuda-graph-impl local` (megatron's CudaGraphManager) or
  `transformer_engine` (`--external-cuda-graph` before), optionally with `--cuda-graph-scope` /
  `--cuda-graph-modules attn mlp ...`: layers replay graphs inside forward_step/backward_step,
  the Python schedule and its hooks still run once per computation.
* **combined_1f1b** -- `--overlap-moe-expert-parallel-comm` (MoE with expert parallelism):
  `forward_backward_no_pipelining` and the interleaved schedule hand training to
  `combined_1f1b.py`, whose `combined_forward_backward_step` runs one microbatch's forward
  together with another's backward (their expert all-to-alls overlapped on other streams) and
  calls neither forward_step nor backward_step; `megatron_combined.py` hooks its units.

`detect(source, version)` reads the same attributes from a parsed `argparse.Namespace` (before
or after Megatron's validate_args) or from a megatron-core `TransformerConfig`, so a script
that never hands perseus-ext its arguments is read from its model's config at the first
iteration. This module imports neither torch nor megatron.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class GraphMode(str, enum.Enum):
    NONE = "none"
    FULL_ITERATION = "full_iteration"  # FullCudaGraphWrapper: the iteration is one graph replay
    PER_LAYER_LOCAL = "local"  # megatron's own per-layer graphs (CudaGraphManager)
    PER_LAYER_TE = "transformer_engine"  # Transformer Engine's make_graphed_callables


COMBINED_1F1B_FLAG = "--overlap-moe-expert-parallel-comm"
DELAYED_WGRAD_FLAG = "--delay-wgrad-compute"  # megatron-core allows it only with the flag above
FIRST_MIGRATING_RELEASE = (0, 18)  # from here a full_iteration scope with impl none becomes impl full_iteration


@dataclass(frozen=True)
class MegatronExecution:
    """What the job's arguments say about how megatron-core executes an iteration."""

    graph_mode: GraphMode
    graph_flags: str | None  # the flags that chose the graph mode, as the user would type them
    combined_1f1b: bool
    delayed_wgrad: bool = False  # weight gradients delayed within combined_1f1b's units

    def describe(self) -> str:
        parts = [f"CUDA graphs: {self.graph_mode.value}" + (f" ({self.graph_flags})" if self.graph_flags else "")]
        if self.combined_1f1b:
            parts.append(f"combined_1f1b ({COMBINED_1F1B_FLAG})")
        return "; ".join(parts)


def _scope_names(value: Any) -> list[str]:
    """Scope entries as names: CudaGraphScope / CudaGraphModule enums, strings, or a
    comma-separated string (TransformerConfig accepts one)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in value.split(",") if part]
    items = value if isinstance(value, (list, tuple, set)) else [value]
    return [getattr(item, "name", item) if not isinstance(item, str) else item for item in items]


def detect(source: Any, version: tuple[int, int]) -> MegatronExecution:
    """The execution mode of a Namespace or TransformerConfig under megatron-core `version`."""
    impl = getattr(source, "cuda_graph_impl", None) or "none"
    impl_flag = f"--cuda-graph-impl {impl}"
    if getattr(source, "enable_cuda_graph", False):  # deprecated; validate_args -> local
        impl, impl_flag = "local", "--enable-cuda-graph"
    elif getattr(source, "external_cuda_graph", False):  # deprecated; validate_args -> transformer_engine
        impl, impl_flag = "transformer_engine", "--external-cuda-graph"
    scopes: list[str] = []
    scope_flag = None
    for attribute, flag in (("cuda_graph_scope", "--cuda-graph-scope"),
                            ("cuda_graph_scope_deprecated", "--cuda-graph-scope"),
                            ("cuda_graph_modules", "--cuda-graph-modules")):
        names = _scope_names(getattr(source, attribute, None))
        if "full_iteration" in names and scope_flag is None:
            scope_flag = f"{flag} full_iteration"
        scopes += names
    combined = bool(getattr(source, "overlap_moe_expert_parallel_comm", False))
    delayed = combined and bool(getattr(source, "delay_wgrad_compute", False))
    full_scope = "full_iteration" in scopes
    if impl == "full_iteration":
        mode, flags = GraphMode.FULL_ITERATION, impl_flag
    elif full_scope and impl == "local":
        mode, flags = GraphMode.FULL_ITERATION, f"{impl_flag} {scope_flag}"
    elif full_scope and impl == "none" and version >= FIRST_MIGRATING_RELEASE:
        mode, flags = GraphMode.FULL_ITERATION, scope_flag
    elif impl == "local":
        mode, flags = GraphMode.PER_LAYER_LOCAL, impl_flag
    elif impl == "transformer_engine":
        mode, flags = GraphMode.PER_LAYER_TE, impl_flag
    else:
        mode, flags = GraphMode.NONE, None
    return MegatronExecution(mode, flags, combined, delayed)


def execution_notes(execution: MegatronExecution) -> list[str]:
    """One info line per mode that changes what perseus-ext hooks, saying how it is planned."""
    notes = []
    if execution.graph_mode is GraphMode.FULL_ITERATION:
        notes.append(f"perseus: full-iteration CUDA graph ({execution.graph_flags}): each FullCudaGraphWrapper "
                     f"call is one iteration; perseus-ext deploys stage-constant plans (one clock per stage, "
                     f"set between replays) solved from perseus.profile_path")
    elif execution.graph_mode is not GraphMode.NONE:
        notes.append(f"perseus: per-layer CUDA graphs ({execution.graph_flags}): megatron-core's schedule still "
                     f"calls forward_step and backward_step once per computation, so clocks are planned and "
                     f"set per computation as without graphs")
    if execution.combined_1f1b:
        notes.append(f"perseus: {COMBINED_1F1B_FLAG}: megatron-core trains with its combined_1f1b schedule; "
                     f"perseus-ext profiles and plans each unit it runs (a forward together with another "
                     f"microbatch's backward, or a lone warm-up forward or cool-down backward) under one clock"
                     + (f"; with {DELAYED_WGRAD_FLAG} the delayed weight gradients run inside each unit, so its "
                        f"profile includes them" if execution.delayed_wgrad else ""))
    return notes
