"""CUDA-graph modes and combined_1f1b recognised from Megatron's arguments, on every supported
megatron-core release (perseus_ext/adapters/megatron_graphs.py).

Megatron-LM's training scripts are not part of the megatron-core wheel, so the arguments each
release's parser produces are written out below, as read from Megatron-LM's
megatron/training/arguments.py at core_r0.16.0 .. core_r0.19.0: `raw` is what `parse_args`
returns (what the patched pretrain_gpt.py hands `install(args)`), `validated` what
`validate_args` leaves (what `get_args()` returns). The installed megatron-core's own
TransformerConfig (what a script without Megatron-LM's arguments has) is checked too.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from perseus_ext.adapters.megatron_graphs import COMBINED_1F1B_FLAG, GraphMode, detect

RELEASES = [(0, 16), (0, 17), (0, 18), (0, 19)]


class Scope:
    """Stand-in for megatron's CudaGraphScope / CudaGraphModule members (name is what counts)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _namespace(release: tuple[int, int], **values) -> argparse.Namespace:
    """The graph-related attributes every release's parser sets, with their defaults."""
    defaults = {"cuda_graph_impl": "none", "enable_cuda_graph": False, "external_cuda_graph": False,
                "overlap_moe_expert_parallel_comm": False}
    if release >= (0, 18):
        defaults.update(cuda_graph_modules=[], cuda_graph_scope_deprecated=None)
    else:
        defaults.update(cuda_graph_scope=[])
    defaults.update(values)
    return argparse.Namespace(**defaults)


def _cases(release: tuple[int, int]):
    """(mode, flags the user typed, raw args, validated args) for each graph mode on `release`."""
    old = release < (0, 18)
    scope_key = "cuda_graph_scope" if old else "cuda_graph_scope_deprecated"
    full = Scope("full_iteration")
    attn = Scope("attn")
    yield GraphMode.NONE, "", _namespace(release), _namespace(release)
    if old:  # 0.16, 0.17: --cuda-graph-impl local --cuda-graph-scope full_iteration
        yield (GraphMode.FULL_ITERATION, "--cuda-graph-impl local --cuda-graph-scope full_iteration",
               _namespace(release, cuda_graph_impl="local", cuda_graph_scope=[full]),
               _namespace(release, cuda_graph_impl="local", cuda_graph_scope=[full]))
        yield (GraphMode.FULL_ITERATION, "--enable-cuda-graph --cuda-graph-scope full_iteration",
               _namespace(release, enable_cuda_graph=True, cuda_graph_scope=[full]),
               _namespace(release, cuda_graph_impl="local", cuda_graph_scope=[full]))
        # impl none: the scope alone captures nothing before 0.18
        yield (GraphMode.NONE, "--cuda-graph-scope full_iteration",
               _namespace(release, cuda_graph_scope=[full]), _namespace(release, cuda_graph_scope=[full]))
    else:  # 0.18+: --cuda-graph-impl full_iteration; the old scope spelling migrates to it
        yield (GraphMode.FULL_ITERATION, "--cuda-graph-impl full_iteration",
               _namespace(release, cuda_graph_impl="full_iteration"),
               _namespace(release, cuda_graph_impl="full_iteration"))
        yield (GraphMode.FULL_ITERATION, "--cuda-graph-scope full_iteration",
               _namespace(release, cuda_graph_scope_deprecated=["full_iteration"]),
               _namespace(release, cuda_graph_impl="full_iteration"))
        yield (GraphMode.FULL_ITERATION, "--cuda-graph-impl local --cuda-graph-modules full_iteration",
               _namespace(release, cuda_graph_impl="local", cuda_graph_modules=["full_iteration"]),
               _namespace(release, cuda_graph_impl="full_iteration"))
    yield (GraphMode.PER_LAYER_LOCAL, "--cuda-graph-impl local",
           _namespace(release, cuda_graph_impl="local"), _namespace(release, cuda_graph_impl="local"))
    yield (GraphMode.PER_LAYER_LOCAL, "--enable-cuda-graph",
           _namespace(release, enable_cuda_graph=True), _namespace(release, cuda_graph_impl="local"))
    modules = {scope_key: [attn]} if old else {"cuda_graph_modules": [attn]}
    yield (GraphMode.PER_LAYER_TE, "--cuda-graph-impl transformer_engine --cuda-graph-modules attn",
           _namespace(release, cuda_graph_impl="transformer_engine", **modules),
           _namespace(release, cuda_graph_impl="transformer_engine", **modules))
    yield (GraphMode.PER_LAYER_TE, "--external-cuda-graph",
           _namespace(release, external_cuda_graph=True), _namespace(release, cuda_graph_impl="transformer_engine"))


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"core_r{r[0]}.{r[1]}")
def test_every_graph_mode_is_recognised_on_every_release(release):
    seen = set()
    for mode, typed, raw, validated in _cases(release):
        for args in (raw, validated):
            execution = detect(args, release)
            assert execution.graph_mode is mode, (typed, args)
            assert not execution.combined_1f1b
        if mode is not GraphMode.NONE:  # the message names what the user typed
            assert set(detect(raw, release).graph_flags.split()) <= set(typed.split())
        seen.add(mode)
    assert seen == set(GraphMode)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"core_r{r[0]}.{r[1]}")
def test_combined_1f1b_is_recognised_on_every_release(release):
    execution = detect(_namespace(release, overlap_moe_expert_parallel_comm=True), release)
    assert execution.combined_1f1b and execution.graph_mode is GraphMode.NONE
    assert COMBINED_1F1B_FLAG in execution.describe()
    both = detect(_namespace(release, overlap_moe_expert_parallel_comm=True, cuda_graph_impl="local"), release)
    assert both.combined_1f1b and both.graph_mode is GraphMode.PER_LAYER_LOCAL


def test_installed_megatron_core_transformer_config_is_read_too():
    """A script without Megatron-LM's arguments: the model's TransformerConfig (0.16 here)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import CudaGraphScope
    from megatron.core.transformer.transformer_config import TransformerConfig

    from perseus_ext.adapters.megatron_surface import installed_version, release_of

    release = release_of(installed_version())

    def config(**values):
        return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, **values)

    assert detect(config(), release).graph_mode is GraphMode.NONE
    assert detect(config(cuda_graph_impl="local"), release).graph_mode is GraphMode.PER_LAYER_LOCAL
    assert detect(config(enable_cuda_graph=True), release).graph_mode is GraphMode.PER_LAYER_LOCAL
    assert detect(config(cuda_graph_impl="transformer_engine", cuda_graph_scope=[CudaGraphScope.attn]),
                  release).graph_mode is GraphMode.PER_LAYER_TE
    full = config(cuda_graph_impl="local", cuda_graph_scope=[CudaGraphScope.full_iteration])
    assert detect(full, release).graph_mode is GraphMode.FULL_ITERATION


def test_install_plans_combined_1f1b_and_says_so_in_one_line_naming_the_flag(caplog):
    pytest.importorskip("megatron.core")
    from perseus_ext.adapters.megatron import add_perseus_args, install

    parser = add_perseus_args(argparse.ArgumentParser())
    args = parser.parse_args(["--perseus", "--perseus-gpu", "sim:a100_sxm"])
    args.overlap_moe_expert_parallel_comm = True
    args.cuda_graph_impl = "none"
    caplog.set_level(logging.INFO, logger="perseus_ext")
    perseus = install(args)
    try:
        assert perseus.execution.combined_1f1b
        assert perseus._config.mode == "optimize"  # planned per unit (tests/test_megatron_combined*.py)
        notes = [r.getMessage() for r in caplog.records if COMBINED_1F1B_FLAG in r.getMessage()]
        assert len(notes) == 1 and "plans each unit it runs" in notes[0]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        perseus.close()


def test_install_says_per_layer_graphs_are_planned_per_computation(caplog):
    pytest.importorskip("megatron.core")
    from perseus_ext.adapters.megatron import add_perseus_args, install

    args = add_perseus_args(argparse.ArgumentParser()).parse_args(["--perseus", "--perseus-gpu", "sim:a100_sxm"])
    args.cuda_graph_impl = "transformer_engine"
    caplog.set_level(logging.INFO, logger="perseus_ext")
    perseus = install(args)
    try:
        assert perseus.execution.graph_mode is GraphMode.PER_LAYER_TE
        assert perseus._config.mode == "optimize"
        assert "per-layer CUDA graphs (--cuda-graph-impl transformer_engine)" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        perseus.close()


def test_delayed_weight_gradients_are_said_to_be_part_of_the_combined_units():
    from perseus_ext.adapters.megatron_graphs import DELAYED_WGRAD_FLAG, execution_notes

    release = RELEASES[0]
    delayed = detect(_namespace(release, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True), release)
    assert delayed.combined_1f1b and delayed.delayed_wgrad
    (note,) = execution_notes(delayed)
    assert COMBINED_1F1B_FLAG in note and f"with {DELAYED_WGRAD_FLAG} the delayed weight gradients run inside each unit" in note
    alone = detect(_namespace(release, delay_wgrad_compute=True), release)  # megatron refuses it without the overlap
    assert not alone.delayed_wgrad and execution_notes(alone) == []
