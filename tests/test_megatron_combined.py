"""megatron-core's combined_1f1b (`--overlap-moe-expert-parallel-comm`) planned per unit.

megatron-core's real interleaved schedule and its real `combined_1f1b_schedule_for_interleaved_pipelining`
decide the order, every pipeline rank a thread of this process (tests/megatron_shims.py; only
the combined step's model work and the CUDA streams are CPU stand-ins). Each rank has perseus-ext's
own wrappers in place, as `install()` puts them, and a real `PerseusRuntime` that checks every
unit against the stage's planned order (it falls back on the first mismatch). The oracle is what
the model chunks themselves saw: the forwards and backwards they ran, in order, and whose output
each consumed.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

from hypothesis import given, settings, strategies as st
from megatron.core.pipeline_parallel import schedules

from megatron_shims import Step, rank_of_current_thread, run_megatron_schedule
from runtime_helpers import make_config, virtual_gpu

from perseus_ext.adapters import megatron_combined
from perseus_ext.adapters.megatron import MegatronPerseus, add_perseus_args, install
from perseus_ext.adapters.megatron_combined import INTERLEAVED_UNIT, executed_order, no_pipelining_order, wrap_unit
from perseus_ext.adapters.megatron_layout import LAYOUT_FLAG, layout_problem
from perseus_ext.adapters.megatron_surface import installed_version, patch_surface
from perseus_ext.errors import ConfigError
from perseus_ext.observability.monitoring import IterationMetrics
from perseus_ext.planning.dag import PipelineDAG
from perseus_ext.planning.schedule import Computation, Kind, combined_1f1b
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.runtime.comm import Member

CHUNKS = 2


@dataclass
class ObservedRank:
    """One pipeline rank's adapter and runtime, and the units the adapter reported."""

    perseus: MegatronPerseus
    runtime: PerseusRuntime
    units: list[Computation] = field(default_factory=list)


def observed_ranks(num_stages: int, num_microbatches: int) -> list[ObservedRank]:
    """Per rank, a runtime in observe mode (it checks the order, sets no clock) on a virtual
    simulated A100, and the adapter that feeds it; its reported units are recorded."""
    schedule = executed_order(num_stages, num_microbatches, CHUNKS) if num_stages > 1 else no_pipelining_order(num_microbatches)
    ranks = []
    for stage in range(num_stages):
        config = make_config(mode="observe", simulated_workload=None)
        runtime = PerseusRuntime(config, schedule=schedule, stage=stage, gpu=virtual_gpu(seed=stage))
        runtime.comm.members = [Member(0, 0, 0)] + ([Member(0, 0, stage)] if stage else [])
        perseus = MegatronPerseus(None)
        perseus._config = config
        perseus.runtime, perseus.metrics = runtime, IterationMetrics(runtime.parts.feed, [])
        perseus.schedule, perseus.stage = schedule, stage
        rank = ObservedRank(perseus, runtime)
        report = runtime.before_computation

        def record(kind, microbatch, chunk=0, parts=(), report=report, rank=rank):
            unit = Computation(rank.perseus.stage, chunk, microbatch, Kind(kind), tuple(parts))
            rank.units.append(unit)
            return report(kind, microbatch, chunk=chunk, parts=parts)

        runtime.before_computation = record
        ranks.append(rank)
    return ranks


@contextlib.contextmanager
def adapter_hooks(ranks: list[ObservedRank], schedules_too: bool = True):
    """Each rank's wrappers (schedules, steps and the combined unit, as `install()` wraps them)
    in place of megatron-core's functions, dispatched by the calling rank thread; without
    `schedules_too` the schedule functions stay megatron's own (a script that looked them up
    before `install()`)."""
    surface = patch_surface(installed_version())
    names = (*(surface.names if schedules_too else ()), INTERLEAVED_UNIT)
    originals = {name: getattr(schedules, name) for name in names}
    wrapped = []
    for rank in ranks:
        wrappers = {}
        if schedules_too:
            wrappers = {name: rank.perseus._wrap_schedule(originals[name]) for name in surface.schedules}
            wrappers.update({name: rank.perseus._wrap_step(originals[name], Kind.FORWARD) for name in surface.forward_steps})
            wrappers.update({name: rank.perseus._wrap_step(originals[name], Kind.BACKWARD)
                             for name in surface.backward_steps})
        wrappers[INTERLEAVED_UNIT] = wrap_unit(rank.perseus, originals[INTERLEAVED_UNIT], interleaved=True)
        wrapped.append(wrappers)

    def dispatcher(name: str):
        def call(*args, **kwargs):
            return wrapped[rank_of_current_thread()][name](*args, **kwargs)
        call.__name__ = name
        return call

    for name in names:
        setattr(schedules, name, dispatcher(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(schedules, name, original)


def as_computation(stage: int, step: Step) -> Computation:
    return Computation(stage, step.chunk, step.microbatch, Kind(step.kind))


@pytest.mark.parametrize("stages, microbatches", [(2, 8), (2, 12), (4, 8), (4, 12)])
def test_executed_units_are_megatron_cores_and_the_plan_graph_is_built_from_them(stages, microbatches):
    ranks = observed_ranks(stages, microbatches)
    try:
        with adapter_hooks(ranks):
            steps = run_megatron_schedule(stages, microbatches, CHUNKS, combined=True)
    finally:
        for rank in ranks:
            rank.runtime.close()
    schedule = ranks[0].perseus.schedule
    assert schedule == combined_1f1b(stages, microbatches, CHUNKS)  # the planner's producer agrees
    dag = PipelineDAG(schedule)
    producer_of: dict[tuple[int, int, str], Computation] = {}  # (virtual stage, microbatch, kind) -> unit
    for stage, rank in enumerate(ranks):
        assert rank.runtime.fallback_reason is None
        assert rank.units, f"stage {stage} reported no unit"
        # What the model chunks ran, in order, is the adapter's units' parts in order (the CPU
        # stand-in runs a combined step's forward, then its backward) ...
        ran = [as_computation(stage, step) for step in steps[stage]]
        assert [part for unit in rank.units for part in unit.units] == ran
        # ... the units are the plan's order on this stage, one per node of the plan's graph ...
        assert rank.units == list(schedule.orders[stage])
        assert {dag.index[unit] for unit in rank.units} <= set(range(len(dag.computations)))
        assert any(unit.kind is Kind.COMBINED for unit in rank.units)
        for unit in rank.units:
            for part in unit.units:
                producer_of[schedule.virtual_stage(part), part.microbatch, part.kind.value] = unit
        assert rank.perseus._unidentified is None
    # ... and every output a chunk consumed from another virtual stage is an edge of the graph.
    consumed_edges = 0
    for stage, rank in enumerate(ranks):
        parts = [(unit, part) for unit in rank.units for part in unit.units]
        for (unit, part), step in zip(parts, steps[stage]):
            if step.consumed is None:
                continue
            virtual, microbatch = step.consumed
            producer = producer_of[virtual, microbatch, step.kind]
            if producer.stage == stage:
                continue  # the stage's own earlier unit: ordered by the stage's chain
            node, source = dag.index[unit], dag.index[producer]
            assert source in dag.pred_idx[dag.pred_ptr[node]:dag.pred_ptr[node + 1]], (unit, producer)
            consumed_edges += 1
    assert consumed_edges > 0


def test_a_plan_that_orders_units_otherwise_than_megatron_core_is_a_config_error(monkeypatch):
    def misplanned(stages, microbatches, chunks, group=None):
        plan = combined_1f1b(stages, microbatches, chunks, group)
        first = list(plan.orders[0])
        first[0], first[1] = first[1], first[0]
        return type(plan)(plan.kind, plan.num_stages, plan.num_microbatches, plan.num_chunks,
                          (tuple(first), *plan.orders[1:]), plan.placement)

    monkeypatch.setattr(megatron_combined, "combined_1f1b", misplanned)
    with pytest.raises(ConfigError, match=r"megatron-core's combined_1f1b runs F0@s0 at position 0 of stage 0"):
        executed_order(2, 8, CHUNKS)


def test_a_unit_out_of_the_plan_falls_back_with_one_error_and_training_goes_on(monkeypatch):
    ranks = observed_ranks(2, 8)
    wrong = executed_order(2, 8, CHUNKS)
    swapped = list(wrong.orders[1])
    swapped[2], swapped[3] = swapped[3], swapped[2]
    for rank in ranks:  # stage 1 plans its third and fourth units the other way round
        rank.runtime.order = tuple(swapped) if rank.perseus.stage == 1 else rank.runtime.order
    try:
        with adapter_hooks(ranks):
            steps = run_megatron_schedule(2, 8, CHUNKS, combined=True)
    finally:
        for rank in ranks:
            rank.runtime.close()
    assert all(len(s) == 2 * 8 * CHUNKS for s in steps)  # every computation still ran
    assert ranks[0].runtime.fallback_reason is None
    reason = ranks[1].runtime.fallback_reason
    assert reason is not None and "where the combined_1f1b schedule expects" in reason and "position 2" in reason


def test_a_schedule_bound_before_install_fails_at_its_first_unit_instead_of_training_without_perseus():
    ranks = observed_ranks(2, 8)
    try:
        with adapter_hooks(ranks, schedules_too=False), pytest.raises(ConfigError, match="before perseus_megatron.install"):
            run_megatron_schedule(2, 8, CHUNKS, combined=True, timeout_s=5)
    finally:
        for rank in ranks:
            rank.runtime.close()
    assert all(not rank.units for rank in ranks)


def test_without_pipeline_parallelism_each_combined_step_is_a_unit(caplog):
    """PP = 1 (observe and power-limit modes): megatron's combined_1f1b_schedule_for_no_pipelining
    calls the combined step directly, hooked as `install()` hooks it."""
    ranks = observed_ranks(1, 4)
    (rank,) = ranks
    try:
        with adapter_hooks(ranks):
            steps = run_megatron_schedule(1, 4, 1, combined=True,
                                          wrap_combined_step=lambda step: wrap_unit(rank.perseus, step, interleaved=False))
    finally:
        rank.runtime.close()
    assert rank.runtime.fallback_reason is None
    assert [str(unit) for unit in rank.units] == ["F0@s0", "(F1@s0;B0@s0)", "(F2@s0;B1@s0)", "(F3@s0;B2@s0)", "B3@s0"]
    assert [part for unit in rank.units for part in unit.units] == [as_computation(0, step) for step in steps[0]]


# ------------------------------------------------------------------------------ layouts
def test_layouts_with_unequal_chunks_on_a_stage_are_refused_at_parse_time(capsys):
    parser = add_perseus_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--perseus", "--pipeline-model-parallel-size", "2",
                           "--pipeline-model-parallel-layout", "Et|tt|ttt|tL"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: pretrain_gpt.py") and len([line for line in err if "error:" in line]) == 1
    assert err[-1].startswith(f"pretrain_gpt.py: error: arguments --perseus, {LAYOUT_FLAG}: {LAYOUT_FLAG} 'Et|tt|ttt|tL'")
    assert "puts 1 and 3 transformer layers on the model chunks of pipeline stage 0;" in err[-1]
    assert err[-1].endswith("or use --perseus-mode observe")
    # asymmetric stages with balanced chunks are planned; observe mode takes any layout
    balanced = parser.parse_args(["--perseus", "--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Et|t|t|tL"])
    assert balanced.pipeline_model_parallel_layout == "Et|t|t|tL"
    observed = parser.parse_args(["--perseus", "--perseus-mode", "observe", "--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Et|tt|ttt|tL"])
    assert observed.perseus_mode == "observe"


def test_a_model_config_carrying_the_layout_is_read_as_the_flag_is():
    """Scripts without Megatron-LM's arguments: the TransformerConfig's parsed layout (checked at
    the first iteration, before the runtime is built)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    assert "puts 1 and 3 transformer layers" in layout_problem(PipelineParallelLayerLayout("Et|tt|ttt|tL", 2), 2)
    assert layout_problem(PipelineParallelLayerLayout("Ett|t|tt|tL", 2), 2) is None  # asymmetric stages, even chunks
    assert layout_problem("not a layout", 2) is None  # megatron-core reports its own parse errors


def test_install_refuses_such_a_layout_before_anything_is_hooked():
    args = add_perseus_args(argparse.ArgumentParser()).parse_args(["--perseus", "--perseus-gpu", "sim:a100_sxm"])
    args.pipeline_model_parallel_size, args.pipeline_model_parallel_layout = 2, "E|tt|t|tL"
    with pytest.raises(ConfigError, match=r"puts 0 and 1 transformer layers on the model chunks of pipeline stage 0;") as refused:
        install(args)
    assert LAYOUT_FLAG in str(refused.value) and "\n" not in str(refused.value)
    assert schedules.forward_step.__module__ == "megatron.core.pipeline_parallel.schedules"  # nothing wrapped


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3).flatmap(lambda stages: st.tuples(
    st.just(stages), st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=stages, max_size=stages))))
def test_a_layout_is_refused_exactly_when_a_stage_holds_chunks_of_different_sizes(case):
    stages, counts = case  # counts[stage][chunk]: transformer layers, two chunks per stage
    segments = [""] * (stages * 2)
    for stage, chunks in enumerate(counts):
        for chunk, layers in enumerate(chunks):
            segments[chunk * stages + stage] = "t" * layers
    segments[0] = "E" + segments[0]
    segments[-1] = segments[-1] + "L"
    layout = "|".join(segments)
    problem = layout_problem(layout, stages)
    unequal = [stage for stage, chunks in enumerate(counts) if chunks[0] != chunks[1]]
    assert (problem is None) == (not unequal), (layout, problem)
    if unequal:
        assert f"pipeline stage {unequal[0]};" in problem and LAYOUT_FLAG in problem
