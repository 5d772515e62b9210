"""Megatron's `--pipeline-model-parallel-layout`: which layouts perseus-ext can plan.

The layout places layers on pipeline stages and, with more segments than stages, on virtual
stages: segment v * PP + p is model chunk v of stage p (megatron-core's
`PipelineParallelLayerLayout`, whose parser this module uses). Stages may hold different layers
(asymmetric stages: the embedding or the loss alone, fewer layers at the ends): the online
profile is taken per stage, so each stage's rows measure what that stage holds.

Within one stage, though, the profiler times every forward of the stage as one kind (and every
backward as another): with model chunks of different transformer-layer counts the median would
describe neither chunk and the plan would be built on a wrong cost. Such a layout in `optimize`
mode is refused before training, naming the flag and what to use instead. The embedding and the
loss layer are not counted: every interleaved Megatron model holds them on one chunk of the
first and last stage, as the default layout does.
"""

from __future__ import annotations

from typing import Any

from perseus_ext.errors import ConfigError

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_TRANSFORMER_LAYERS = ("decoder", "mtp")


def chunk_layer_counts(layout: Any, num_stages: int | None) -> list[list[int]] | None:
    """Transformer layers (decoder + MTP) per model chunk, `counts[stage][chunk]`, of a layout
    string, list or megatron-core `PipelineParallelLayerLayout`; None when there is none or
    megatron-core cannot read it (megatron-core then reports it itself)."""
    if layout is None:
        return None
    rows = getattr(layout, "layout", None)
    if rows is None:
        if not isinstance(num_stages, int) or num_stages < 1:
            return None
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        try:
            rows = PipelineParallelLayerLayout(layout, num_stages).layout
        except (AssertionError, ValueError, KeyError, TypeError):
            return None
    return [[sum(getattr(layer, "name", str(layer)) in _TRANSFORMER_LAYERS for layer in chunk) for chunk in stage]
            for stage in rows]


def layout_problem(layout: Any, num_stages: int | None) -> str | None:
    """Why perseus-ext cannot plan per-computation clocks for `layout` (None: it can)."""
    counts = chunk_layer_counts(layout, num_stages)
    if counts is None:
        return None
    for stage, chunks in enumerate(counts):
        if len(set(chunks)) > 1:
            return (f"{LAYOUT_FLAG} '{layout!s}' puts {' and '.join(map(str, chunks))} transformer layers on "
                    f"the model chunks of pipeline stage {stage}; perseus-ext profiles one forward and "
                    f"one backward per stage over all its chunks, so the chunks of a stage must hold equal "
                    f"numbers of transformer layers (stages may differ from each other): balance each "
                    f"stage's chunks in the layout, or use --perseus-mode observe")
    return None


def check_layout(source: Any, config: Any) -> None:
    """A `ConfigError` naming the flag when `config` plans clocks (mode optimize) for a layout
    of `source` (Megatron's arguments or a TransformerConfig) that it cannot plan."""
    if config is None or getattr(config, "mode", None) != "optimize":
        return
    problem = layout_problem(getattr(source, "pipeline_model_parallel_layout", None),
                             getattr(source, "pipeline_model_parallel_size", None))
    if problem is not None:
        raise ConfigError(f"perseus: {problem}", keys=("perseus.mode",))
