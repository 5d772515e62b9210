"""The orders torch.distributed.pipelining's own schedule classes run, built offline.

`perseus-ext emulate` plans the zero-bubble and DualPipeV schedules without a cluster, and
without a copy of their algorithms: a schedule class computes every rank's `pipeline_order` in
its constructor from what it reads of its stages (index, count, group size and rank), so this
module constructs the class for pipeline rank 0 with stand-in stages that carry exactly those
attributes (no module, no tensors, no process group) and converts the order with the adapter's
own conversion (`torch_pipelining_actions.orders_from_pipeline_order`): the planner gets the
same `Computation`s the torch adapter checks a running job against.

torch is imported when an order is built, not when this module loads, so a command can refuse
a torch schedule in one line where torch is missing (`torch_available`).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

from perseus_ext.adapters.torch_pipelining_actions import RankLayout, orders_from_pipeline_order
from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import Kind, PipelineSchedule, ScheduleKind, schedule_from_actions

TORCH_EXTRA = "torch"  # the pyproject extra that brings torch.distributed.pipelining


@dataclass(frozen=True)
class TorchScheduleClass:
    """One torch schedule class: its name, how it lays model chunks on ranks (torch's `style`
    of `generate_stage_to_rank_mapping`), and the chunks per rank it accepts (None: any)."""

    class_name: str
    style: str
    fixed_chunks: int | None


TORCH_SCHEDULES: dict[ScheduleKind, TorchScheduleClass] = {
    ScheduleKind.ZERO_BUBBLE: TorchScheduleClass("ScheduleInterleavedZeroBubble", "loop", None),
    ScheduleKind.ZBV: TorchScheduleClass("ScheduleZBVZeroBubble", "v", 2),
    ScheduleKind.DUALPIPE_V: TorchScheduleClass("ScheduleDualPipeV", "v", 2),
}


def torch_available() -> bool:
    """Whether torch.distributed.pipelining's schedules can be imported here (a CPU build of
    torch has them; a build without torch.distributed does not)."""
    try:
        importlib.import_module("torch.distributed.pipelining.schedules")
    except ImportError:
        return False
    return True


class _OrderOnlyStage:
    """What a torch schedule's constructor reads of a pipeline stage to compute its order."""

    def __init__(self, index: int, num_stages: int, group_size: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = group_size, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] | None = None
        self.submod = None  # read by the check for torch.compile'd modules


def torch_schedule(kind: ScheduleKind | str, num_ranks: int, num_microbatches: int,
                   num_chunks: int | None = None) -> PipelineSchedule:
    """The planner schedule of the torch class behind `kind` for `num_ranks` pipeline ranks,
    `num_microbatches` microbatches and `num_chunks` model chunks per rank (default 2; the
    V-shaped classes run exactly 2): the compute actions of torch's own `pipeline_order`, an overlapped
    forward+backward as its two parts (as the torch adapter records them running). A size the
    torch class refuses is a ConfigError quoting torch's reason."""
    names = ", ".join(k.value for k in TORCH_SCHEDULES)
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        raise ConfigError(f"unknown schedule {kind!r}; torch schedules built offline: {names}") from None
    if kind not in TORCH_SCHEDULES:
        raise ConfigError(f"{kind.value!r} is not a torch.distributed.pipelining schedule perseus-ext builds "
                          f"offline; use one of: {names}")
    spec = TORCH_SCHEDULES[kind]
    chunks = num_chunks if num_chunks is not None else (spec.fixed_chunks or 2)
    if spec.fixed_chunks is not None and chunks != spec.fixed_chunks:
        raise ConfigError(f"torch's {spec.class_name} runs exactly {spec.fixed_chunks} model chunks per rank, "
                          f"not {chunks}")
    if num_ranks < 2 and spec.style == "v":
        raise ConfigError(f"torch's {spec.class_name} needs at least 2 pipeline ranks, got {num_ranks}")
    try:
        torch_schedules = importlib.import_module("torch.distributed.pipelining.schedules")
        generate_stage_to_rank_mapping = importlib.import_module(
            "torch.distributed.pipelining._utils").generate_stage_to_rank_mapping
    except ImportError as err:
        raise ConfigError(f"the {kind.value} schedule is built by torch.distributed.pipelining, which cannot be "
                          f"imported ({err}); install the {TORCH_EXTRA!r} extra: pip install "
                          f"'perseus-ext[{TORCH_EXTRA}]'") from None
    cls = getattr(torch_schedules, spec.class_name, None)
    if cls is None:
        raise ConfigError(f"this torch ({_torch_version()}) has no {spec.class_name}; upgrade torch for the "
                          f"{kind.value} schedule")
    num_stages = num_ranks * chunks
    rank_of = generate_stage_to_rank_mapping(num_ranks, num_stages, style=spec.style)
    stages = [_OrderOnlyStage(index, num_stages, num_ranks) for index in range(num_stages) if rank_of[index] == 0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = cls(stages, num_microbatches)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ConfigError(f"torch's {spec.class_name} refuses {num_ranks} pipeline ranks x {chunks} chunks with "
                          f"{num_microbatches} microbatches: {' '.join(str(err).split())}") from None
    indices = [[index for index in range(num_stages) if rank_of[index] == rank] for rank in range(num_ranks)]
    layout = RankLayout.from_indices(indices)
    orders = [[c for c in order if c.kind is not Kind.REDUCE_GRAD]
              for order in orders_from_pipeline_order(built.pipeline_order, layout)]
    return schedule_from_actions(orders, layout.placement, kind)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
