"""`perseus-ext emulate --schedule` for the zero-bubble, DualPipeV and combined_1f1b schedules.

The torch schedules' orders come from torch.distributed.pipelining's own classes, built offline
(`adapters.torch_pipelining_orders`); here they are held to the actions torch's runtime would
execute (`pipeline_order_with_comms`, read with torch's own stage-to-rank mapping) and to the torch
adapter's conversion. The emulator's figures for them are held to an independent replay: an
event loop over the stages written from torch's action semantics (a forward needs the previous
model chunk's forward, an input gradient the next chunk's, a weight gradient its own input
gradient), the profile read with the csv module and the input/weight split applied here, not by
`planning.derived`.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Sequence

import pytest

from perseus_ext.cli import main
from perseus_ext.emulator import Emulator, JobLayout, StragglerScenario
from perseus_ext.emulator.core import STRATEGIES
from perseus_ext.errors import ConfigError
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import Computation, Kind
from pipeline_replay import PipelineRun, StageProfile, job_iteration

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
from perseus_ext.adapters.torch_pipelining_actions import RankLayout, orders_from_pipeline_order  # noqa: E402
from perseus_ext.adapters.torch_pipelining_orders import torch_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT3_A100 = ROOT / "examples" / "profiles" / "gpt3-175b-a100_sxm.csv"
PROFILE = ["--profile", "gpt3-175b-a100_sxm"]
BLOCKING_W, TP, SCALE = 83.64, 2, 10
EXACT = 1e-9
CLASSES = {"zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"), "zbv": ("ScheduleZBVZeroBubble", "v"),
           "dualpipev": ("ScheduleDualPipeV", "v")}


# ------------------------------------------------------------------ the orders are torch's


class _Stage:
    """What a torch schedule reads of a stage while it builds its order."""

    def __init__(self, index: int, num_stages: int, group_size: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, group_size, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank = None
        self.submod = None


_KINDS = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.INPUT_GRADIENT, "W": Kind.WEIGHT_GRADIENT}


def executed_by_torch(kind: str, ranks: int, microbatches: int):
    """(per-rank compute actions torch's runtime executes, as Computations; placement), read from
    `pipeline_order_with_comms` with torch's rank-to-stage mapping; overlapped F+B as its parts."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    name, style = CLASSES[kind]
    num_stages = 2 * ranks
    held = generate_rank_to_stage_mapping(ranks, num_stages, style=style)
    where = {index: (rank, sorted(indices).index(index)) for rank, indices in held.items() for index in indices}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = getattr(pipelining, name)([_Stage(i, num_stages, ranks) for i in held[0]], microbatches)
    orders = []
    for rank in range(ranks):
        order = []
        for action in built.pipeline_order_with_comms[rank]:
            parts = action.sub_actions if action.computation_type.value == "OVERLAP_F_B" else (action,)
            order += [Computation(*where[a.stage_index], a.microbatch_index, _KINDS[a.computation_type.value])
                      for a in parts if a.computation_type.value in _KINDS]
        orders.append(order)
    return orders, [where[v] for v in range(num_stages)], built


@pytest.mark.parametrize("kind", sorted(CLASSES))
@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (4, 8)])
def test_the_offline_orders_are_what_torch_executes_and_what_the_adapter_converts(kind, ranks, microbatches):
    schedule = torch_schedule(kind, ranks, microbatches)
    executed, placement, built = executed_by_torch(kind, ranks, microbatches)
    forwards = [(c.stage, c.chunk, c.microbatch) for order in executed for c in order if c.kind is Kind.FORWARD]
    assert len(forwards) == len(set(forwards)) == 2 * ranks * microbatches  # every chunk, every microbatch
    assert [list(order) for order in schedule.orders] == executed
    assert list(schedule.placement) == placement
    layout = RankLayout.from_indices([[v for v, (r, _) in enumerate(placement) if r == rank] for rank in range(ranks)])
    adapter = [[c for c in order if c.kind is not Kind.REDUCE_GRAD]
               for order in orders_from_pipeline_order(built.pipeline_order, layout)]
    assert [list(order) for order in schedule.orders] == adapter
    kinds = {c.kind for order in executed for c in order}
    assert {Kind.FORWARD, Kind.INPUT_GRADIENT, Kind.WEIGHT_GRADIENT} <= kinds
    if kind == "dualpipev":
        assert Kind.BACKWARD in kinds  # the overlapped steps' full backwards


def test_a_size_torch_refuses_is_a_config_error_quoting_torch():
    with pytest.raises(ConfigError, match="ScheduleDualPipeV refuses 4 pipeline ranks x 2 chunks with 6 "
                                          "microbatches: DualPipeV requires at least as many microbatches"):
        torch_schedule("dualpipev", 4, 6)
    with pytest.raises(ConfigError, match="runs exactly 2 model chunks per rank, not 3"):
        torch_schedule("zbv", 4, 8, 3)


# ------------------------------------------------------------------ the command


# The fewest microbatches each schedule takes at 4 ranks x 2 chunks (DualPipeV: one per stage).
@pytest.mark.parametrize("schedule, extra, microbatches, estimated", [
    ("zb-v", [], 4, "input_gradient = 0.5 x backward; weight_gradient = 0.5 x backward"),
    ("dualpipev", [], 8, "input_gradient = 0.5 x backward; weight_gradient = 0.5 x backward"),
    ("zero-bubble", ["--chunks", "2", "--input-gradient-share", "0.4"], 4,
     "input_gradient = 0.4 x backward; weight_gradient = 0.6 x backward"),
    ("combined_1f1b", ["--chunks", "2", "--overlap-share", "0.25"], 4,
     "combined = forward + backward - 0.25 x min(forward, backward) in time"),
])
def test_the_new_schedules_run_through_the_command_and_state_their_estimate(schedule, extra, microbatches, estimated,
                                                                             capsys):
    assert main(["emulate", *PROFILE, "--pp", "4", "--schedule", schedule, *extra, "--microbatches", str(microbatches),
                 "--global-batch", str(2 * microbatches), "--sweep", "1.0", "1.2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"profile gpt3-175b-a100_sxm.csv: {schedule} (2 chunks per stage)")
    assert "estimated from the forward/backward profile (the legends say how)" in out
    legend = " ".join(line.strip() for line in out.splitlines() if line.startswith("  "))
    assert "estimated kinds: gpt3-175b-a100_sxm.csv has no" in legend
    assert estimated in legend and "a model, not a measurement" in legend
    row = next(line for line in out.splitlines() if line.startswith("1.20 "))
    total = float(row.split()[1].rstrip("%"))
    assert 0 < total < 100


def test_1f1b_states_no_estimate(capsys):
    assert main(["emulate", *PROFILE, "--microbatches", "8", "--sweep", "1.0"]) == 0
    assert "estimated" not in capsys.readouterr().out


def _one_error_line(capsys, args: list[str]) -> str:
    assert main(["emulate", *PROFILE, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("perseus-ext emulate: error: "), err
    return err[0]


@pytest.mark.parametrize("schedule", ["zb-v", "zero-bubble", "dualpipev"])
def test_without_torch_a_torch_schedule_is_one_error_line_naming_the_extra(schedule, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining.schedules", None)  # import fails
    line = _one_error_line(capsys, ["--schedule", schedule, "--microbatches", "8"])
    assert f"--schedule {schedule}: its order comes from torch.distributed.pipelining" in line
    assert "install the 'torch' extra (pip install 'perseus-ext[torch]')" in line
    with pytest.raises(ConfigError, match=r"install the 'torch' extra"):
        torch_schedule("zbv", 4, 8)  # the builder refuses as plainly when called directly


@pytest.mark.parametrize("args, message", [
    (["--schedule", "zb-v", "--chunks", "3"], "--chunks 3: zb-v runs exactly 2 model chunks per stage"),
    (["--schedule", "1f1b", "--input-gradient-share", "0.4"], "--input-gradient-share: the 1f1b schedule runs no"),
    (["--schedule", "zb-v", "--overlap-share", "0.2"], "--overlap-share: the zb-v schedule emulated here runs no"),
    (["--schedule", "dualpipev", "--pp", "4"], "ScheduleDualPipeV refuses 4 pipeline ranks x 2 chunks with 6"),
    (["--schedule", "zb-v", "--pp", "3"], "--pp 3: zb-v runs 2 chunks per stage, so the profile "
                                          "gpt3-175b-a100_sxm.csv's 8 stages must be the pipeline's stages or "
                                          "its chunks; give --pp 4 or 8"),
])
def test_bad_schedule_flags_are_one_error_line(args, message, capsys):
    line = _one_error_line(capsys, [*args, "--microbatches", "6"])
    assert message in line


# ------------------------------------------------------------------ the emulator against a replay


def v_shape(stage: int, chunk: int, stages: int) -> int:
    """torch's V layout: rank s holds model chunk s on the way down and 2S - 1 - s on the way up."""
    return stage if chunk == 0 else 2 * stages - 1 - stage


def point(profile: StageProfile, virtual: int, kind: str, mhz: int) -> tuple[float, float]:
    """(s, J) of one computation; the input/weight halves of a backward are half of it each
    (the emulator's default input-gradient share), written here from the profile's rows."""
    if kind in ("input_gradient", "weight_gradient"):
        seconds, joules = profile.points[virtual, "backward", mhz]
        return 0.5 * seconds, 0.5 * joules
    return profile.points[virtual, kind, mhz]


def replay_actions(orders: Sequence[Sequence[Computation]], clocks, profile: StageProfile) -> PipelineRun:
    """One iteration of a V-shaped pipeline run as an event loop: each stage runs its actions in
    order, each starting when its stage is free and what it consumes has finished."""
    stages = len(orders)
    last = 2 * stages - 1
    finished: dict[tuple[str, int, int], float] = {}
    free_at, busy, position = [0.0] * stages, [0.0] * stages, [0] * stages
    energy, remaining = 0.0, sum(map(len, orders))

    def produced(c: Computation) -> str:
        return {"forward": "F", "weight_gradient": "W"}.get(c.kind.value, "G")  # G: the input gradient

    def needs(c: Computation, v: int) -> list[tuple[str, int, int]]:
        m = c.microbatch
        if c.kind is Kind.FORWARD:
            return [("F", v - 1, m)] if v > 0 else []
        if c.kind is Kind.WEIGHT_GRADIENT:
            return [("G", v, m)]
        return [("F", v, m)] + ([("G", v + 1, m)] if v < last else [])

    while remaining:
        progressed = False
        for stage in range(stages):
            while position[stage] < len(orders[stage]):
                c = orders[stage][position[stage]]
                v = v_shape(c.stage, c.chunk, stages)
                wanted = needs(c, v)
                if any(key not in finished for key in wanted):
                    break
                start = max([free_at[stage]] + [finished[key] for key in wanted])
                seconds, joules = point(profile, v, c.kind.value, int(clocks[stage][position[stage]]))
                finished[produced(c), v, c.microbatch] = free_at[stage] = start + seconds
                busy[stage] += seconds
                energy += joules
                position[stage] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the schedule deadlocks"
    return PipelineRun(max(free_at), tuple(busy), energy, {})


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_the_emulators_figures_for_a_zero_bubble_schedule_are_the_independent_replay(kind):
    ranks, microbatches, dp = 4, 8, 3
    actions = torch_schedule(kind, ranks, microbatches)
    layout = JobLayout(TP, ranks, dp * microbatches, microbatches, schedule=kind, chunks=2, actions=actions)
    emulator = Emulator(load_profile(GPT3_A100), layout, BLOCKING_W, time_scale=SCALE)
    assert emulator.derived_kinds == ("input_gradient", "weight_gradient")
    profile = StageProfile.read(GPT3_A100, time_scale=SCALE, energy_scale=SCALE * TP)  # 8 rows = 8 chunks
    stage_blocking_w = BLOCKING_W * TP
    orders = emulator.schedule.orders

    top = replay_actions(orders, [[1410] * len(order) for order in orders], profile)
    assert emulator.reference_time == pytest.approx(top.time_s, rel=EXACT)
    factor = 1.2
    held = factor * top.time_s
    baseline = job_iteration(top, top, dp, stage_blocking_w, held)
    result = emulator.run(StragglerScenario.fixed(factor))
    assert set(result.outcomes) == set(STRATEGIES)
    for name, outcome in result.outcomes.items():
        (deployment,) = outcome.deployments
        runs = [replay_actions(orders, [plan.for_stage(s) for s in range(ranks)], profile)
                for plan in (deployment.straggler, deployment.others)]
        ours = job_iteration(*runs, dp, stage_blocking_w, held)
        assert outcome.iteration.time == pytest.approx(ours.time_s, rel=EXACT), name
        assert outcome.iteration.total == pytest.approx(ours.energy_j, rel=EXACT), name
        assert outcome.saving == pytest.approx(1 - ours.energy_j / baseline.energy_j, rel=1e-7, abs=1e-12), name
    assert result.total_saving > result.intrinsic_saving > 0


def test_a_layout_refuses_actions_built_for_another_size():
    actions = torch_schedule("zbv", 4, 8)
    assert JobLayout(1, 4, 8, 8, schedule="zbv", chunks=2, actions=actions).build_schedule() is actions
    with pytest.raises(ConfigError, match="the action list is a zbv schedule of 4 stages, 8 microbatches and 2 "
                                          "chunks per stage, but the layout asks for zbv with 4, 16 and 2"):
        JobLayout(1, 4, 16, 16, schedule="zbv", chunks=2, actions=actions)
