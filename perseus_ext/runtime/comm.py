"""The runtime's control plane: tiny CPU collectives among the ranks of a training job.

Why separate gloo groups: the runtime exchanges flags, iteration times, profiles and frontiers.
Doing that on the framework's own (often NCCL) groups would need device tensors and would
interleave with the training's collectives; dedicated gloo groups keep both apart, work with any
training backend, and carry a timeout so a dead rank makes the others fall back to default clocks
instead of hanging forever.

Every collective here is called by *all* ranks of the job at the same iteration (the runtime's
lifecycle is driven by agreed results only), which is what keeps them deadlock-free.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Member:
    """Where one rank sits in the job: which data-parallel pipeline and which stage."""

    rank: int
    pipeline: int
    stage: int


class ControlPlane:
    """Collectives over the whole job and over this rank's pipeline (single process: no-ops)."""

    def __init__(self, *, stage: int, dp_group: Any = None, timeout_s: float = 600.0) -> None:
        self.stage = stage
        self._dist = None
        self._world = None
        self._pipeline_group = None
        self.rank = 0
        self.pipeline = 0
        self.members: list[Member] = [Member(0, 0, stage)]
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        self._dist = dist
        self.rank = dist.get_rank()
        self.pipeline = dist.get_rank(dp_group) if dp_group is not None else 0
        timeout = datetime.timedelta(seconds=timeout_s)
        # Every rank creates every group, in the same order (a torch.distributed requirement).
        self._world = dist.new_group(backend="gloo", timeout=timeout)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.rank, self.pipeline, stage), group=self._world)
        self.members = [Member(*item) for item in gathered]
        for pipeline in sorted({m.pipeline for m in self.members}):
            ranks = sorted(m.rank for m in self.members if m.pipeline == pipeline)
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            if pipeline == self.pipeline:
                self._pipeline_group = group

    @property
    def distributed(self) -> bool:
        return self._dist is not None

    @property
    def pipeline_members(self) -> list[Member]:
        return [m for m in self.members if m.pipeline == self.pipeline]

    @property
    def num_pipelines(self) -> int:
        return len({m.pipeline for m in self.members})

    @property
    def gpus_per_stage(self) -> int:
        """Ranks sharing this rank's pipeline and stage (its tensor-parallel peers and itself)."""
        return sum(1 for m in self.members if m.pipeline == self.pipeline and m.stage == self.stage)

    def broadcast_job(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank of the job (e.g. a job id all ranks must share)."""
        if self._dist is None:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self._world)
        return box[0]

    def pipeline_leader(self, pipeline: int | None = None) -> int:
        """Global rank that solves (and sends) a pipeline's frontier: its first stage-0 rank."""
        pipeline = self.pipeline if pipeline is None else pipeline
        return min(m.rank for m in self.members if m.pipeline == pipeline and m.stage == 0)

    @property
    def is_pipeline_leader(self) -> bool:
        return self.rank == self.pipeline_leader()

    def all_min(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, "min")

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, "max")

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over every rank of the job (the power-limit optimizer's all-reduce:
        one global limit is priced on the energy of all GPUs)."""
        return self._all_reduce(values, "sum")

    def _all_reduce(self, values: Sequence[float], op: str) -> list[float]:
        if self._dist is None:
            return [float(v) for v in values]
        import torch

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        reduce_op = {"min": self._dist.ReduceOp.MIN, "max": self._dist.ReduceOp.MAX,
                     "sum": self._dist.ReduceOp.SUM}[op]
        self._dist.all_reduce(tensor, op=reduce_op, group=self._world)
        return tensor.tolist()

    def all_gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's `values` (same length everywhere), indexed by global rank."""
        if self._dist is None:
            return [[float(v) for v in values]]
        import torch

        mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self._dist.get_world_size())]
        self._dist.all_gather(out, mine, group=self._world)
        return [t.tolist() for t in out]

    def gather_pipeline(self, obj: Any) -> list[tuple[Member, Any]]:
        """Every pipeline member's `obj`, with who sent it."""
        if self._dist is None:
            return [(self.members[0], obj)]
        members = self.pipeline_members
        out: list[Any] = [None] * len(members)
        self._dist.all_gather_object(out, (self.rank, obj), group=self._pipeline_group)
        by_rank = {m.rank: m for m in members}
        return [(by_rank[rank], value) for rank, value in out]

    def broadcast_pipeline(self, obj: Any) -> Any:
        """The pipeline leader's `obj` on every rank of the pipeline."""
        if self._dist is None:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=self.pipeline_leader(), group=self._pipeline_group)
        return box[0]
