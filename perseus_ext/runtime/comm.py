"""The runtime's control plane: tiny CPU collectives among the ranks of a training job.

Why separate gloo groups: the runtime exchanges flags, iteration times, profiles and frontiers.
Doing that on the framework's own (often NCCL) groups would need device tensors and would
interleave with the training's collectives; dedicated gloo groups keep both apart, work with any
training backend, and carry a timeout so a dead rank makes the others fall back to default clocks
instead of hanging forever.

Every collective here is called by *all* ranks of the job at the same iteration (the runtime's
lifecycle is driven by agreed results only), which is what keeps them deadlock-free.

Why two small groups instead of one world group: at 10k+ GPUs a world-wide gloo collective is
a host-wide barrier over TCP. A job-wide reduction is done in two steps instead: within the
rank's pipeline (its PP x TP ranks), then among its data-parallel peers (the ranks at the same
stage and tensor-parallel slot of every pipeline, DP ranks). After both, every rank holds the
job-wide result. The world group is used once, at set-up, to learn who is where. Message and
byte counts per rank are in docs/control-plane.md and counted in `ControlPlane.stats`.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

FLOAT_BYTES = 8
CLOSE_WAIT_S = 1.0  # how long `close` waits for a collective still in flight (a straggler check)

logger = logging.getLogger(__name__)


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
        self._peer_group = None
        self.peer_ranks: list[int] = [0]
        self.stats: collections.Counter[str] = collections.Counter()  # collectives and bytes per group
        self.rank = 0
        self.pipeline = 0
        self.members: list[Member] = [Member(0, 0, stage)]
        self._unfinished: list[Any] = []  # collectives started and not waited for to the end
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
        for key, ranks in sorted(self._peer_sets().items()):
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            if self.rank in ranks:
                self._peer_group, self.peer_ranks = group, ranks

    def _peer_sets(self) -> dict[tuple[int, int], list[int]]:
        """Data-parallel peers: (stage, tensor-parallel slot) -> the ranks holding it in every
        pipeline. A slot is a rank's position among its stage's ranks of its pipeline."""
        by_place: dict[tuple[int, int], list[Member]] = collections.defaultdict(list)
        for member in self.members:
            by_place[member.pipeline, member.stage].append(member)
        peers: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        for (_, stage), placed in by_place.items():
            for slot, member in enumerate(sorted(placed, key=lambda m: m.rank)):
                peers[stage, slot].append(member.rank)
        return {key: sorted(ranks) for key, ranks in peers.items()}

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
        """Rank 0's `obj` on every rank of the job (set-up only: a job id all ranks share)."""
        if self._dist is None:
            return obj
        self._count("world", 1)
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
        """Job-wide element-wise reduction in two steps: the pipeline, then the DP peers."""
        if self._dist is None:
            return [float(v) for v in values]
        import torch

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        reduce_op = {"min": self._dist.ReduceOp.MIN, "max": self._dist.ReduceOp.MAX,
                     "sum": self._dist.ReduceOp.SUM}[op]
        for name, group, size in (("pipeline", self._pipeline_group, len(self.pipeline_members)),
                                  ("peers", self._peer_group, len(self.peer_ranks))):
            if size > 1:
                self._dist.all_reduce(tensor, op=reduce_op, group=group)
                self._count(name, len(values))
        return tensor.tolist()

    def _count(self, group: str, floats: int) -> None:
        self.stats[f"{group} collectives"] += 1
        self.stats[f"{group} payload bytes"] += floats * FLOAT_BYTES

    def straggler_exchange(self, own_s: float | None, announced_factor: float,
                           announced_time_s: float, wait_noise_s: float = 0.0) -> ExchangeResult:
        """One straggler check, waited for at once (`StragglerExchange` spreads it over
        iteration boundaries instead)."""
        exchange = StragglerExchange(self, own_s, announced_factor, announced_time_s, wait_noise_s)
        result = None
        while result is None:
            result = exchange.advance()
        return result

    def start_max(self, group: str, values: Sequence[float]) -> "Pending":
        """Element-wise max within this rank's "pipeline" or "peers" group, started without
        waiting: gloo runs it on its own threads while training goes on."""
        handle, size = {"pipeline": (self._pipeline_group, len(self.pipeline_members)),
                        "peers": (self._peer_group, len(self.peer_ranks))}[group]
        if self._dist is None or size <= 1:
            return Pending([float(v) for v in values])
        import torch

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        work = self._started(self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=handle, async_op=True))
        self._count(group, len(values))
        return Pending(tensor, work)

    def start_broadcast_pipeline(self, values: Sequence[float] | None, length: int) -> "Pending":
        """The pipeline leader's `values` (`length` floats; None on the other ranks) on every
        rank of the pipeline, started without waiting."""
        if self._dist is None or len(self.pipeline_members) <= 1:
            return Pending([float(v) for v in values])
        import torch

        tensor = (torch.tensor([float(v) for v in values], dtype=torch.float64) if values is not None
                  else torch.zeros(length, dtype=torch.float64))
        work = self._started(self._dist.broadcast(tensor, src=self.pipeline_leader(),
                                                  group=self._pipeline_group, async_op=True))
        self._count("pipeline", length)
        return Pending(tensor, work)

    def gather_pipeline(self, obj: Any) -> list[tuple[Member, Any]]:
        """Every pipeline member's `obj`, with who sent it."""
        if self._dist is None:
            return [(self.members[0], obj)]
        self.stats["pipeline object collectives"] += 1
        members = self.pipeline_members
        out: list[Any] = [None] * len(members)
        self._dist.all_gather_object(out, (self.rank, obj), group=self._pipeline_group)
        by_rank = {m.rank: m for m in members}
        return [(by_rank[rank], value) for rank, value in out]

    def scatter_pipeline(self, by_rank: dict[int, Any] | None) -> Any:
        """This rank's entry of the pipeline leader's `by_rank` (global rank -> object)."""
        if self._dist is None:
            return by_rank[self.rank]
        self.stats["pipeline object collectives"] += 1
        ranks = sorted(m.rank for m in self.pipeline_members)  # the group's rank order
        inputs = [by_rank[rank] for rank in ranks] if by_rank is not None else None
        out: list[Any] = [None]
        self._dist.scatter_object_list(out, inputs, src=self.pipeline_leader(), group=self._pipeline_group)
        return out[0]

    def broadcast_pipeline(self, obj: Any) -> Any:
        """The pipeline leader's `obj` on every rank of the pipeline."""
        if self._dist is None:
            return obj
        self.stats["pipeline object collectives"] += 1
        box = [obj]
        self._dist.broadcast_object_list(box, src=self.pipeline_leader(), group=self._pipeline_group)
        return box[0]

    def all_reduce_by(self, values: Sequence[float], op: str, deadline_s: float | None) -> list[float]:
        """`all_sum` / `all_max` that gives up at `deadline_s` (`time.monotonic()`) with a
        TimeoutError instead of waiting out the groups' timeout: at close, where a rank whose
        peers never come must still exit. A step given up stays pending in gloo (no Python
        thread waits on it) and completes if the peers come later, or fails at the groups'
        timeout. `deadline_s` None: the groups' timeout."""
        if self._dist is None:
            return [float(v) for v in values]
        import torch

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        reduce_op = {"max": self._dist.ReduceOp.MAX, "sum": self._dist.ReduceOp.SUM}[op]
        for name, group, size in (("pipeline", self._pipeline_group, len(self.pipeline_members)),
                                  ("peers", self._peer_group, len(self.peer_ranks))):
            if size > 1:
                work = self._started(self._dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True))
                try:
                    work.wait() if deadline_s is None else work.wait(
                        datetime.timedelta(seconds=max(deadline_s - time.monotonic(), 0.001)))
                except RuntimeError:
                    if deadline_s is None or time.monotonic() < deadline_s - 0.1:
                        raise  # a peer died, the group broke or timed out itself
                    raise TimeoutError(f"the {name} group's ranks did not all join in time") from None
                self._count(name, len(values))
        return tensor.tolist()

    def _started(self, work: Any) -> Any:
        """Remember a collective started without waiting (`close` must know if it finished)."""
        self._unfinished = [w for w in self._unfinished if not w.is_completed()]
        self._unfinished.append(work)
        return work

    def close(self) -> None:
        """Destroy this control plane's gloo groups once its collectives are over.

        Why: a gloo worker thread releases a finished collective a little after its waiter
        moved on; if that falls into interpreter finalization, releasing the tensor needs the
        GIL and the process aborts ("terminate called without an active exception", exit -6;
        docs/control-plane.md has the core dump). Destroying joins the group's threads now,
        while the interpreter is whole. Skipped while a collective
        of ours is unfinished (a peer that never came): joining would wait for it, and a rank
        must exit in bounded time; one still in flight gets `CLOSE_WAIT_S` to finish (a
        straggler check started at the last iteration boundary, which every rank issued).
        Afterwards every collective is a local no-op. Idempotent; never raises."""
        groups = [g for g in (self._world, self._pipeline_group, self._peer_group) if g is not None]
        dist, self._dist = self._dist, None
        self._world = self._pipeline_group = self._peer_group = None
        if dist is None or not groups:
            return
        if not self._all_finished(time.monotonic() + CLOSE_WAIT_S):
            logger.debug("perseus-ext: a control-plane collective is unfinished; its groups are left to exit")
            return
        self._unfinished.clear()
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except Exception as err:  # the job's own groups may be gone already
                logger.debug("perseus-ext: destroying a control-plane group failed: %s", err)

    def _all_finished(self, deadline_s: float) -> bool:
        """Whether every collective started without waiting has finished by `deadline_s`."""
        for work in self._unfinished:
            if work.is_completed():
                continue
            try:
                work.wait(datetime.timedelta(seconds=max(deadline_s - time.monotonic(), 0.001)))
            except Exception:  # timed out, or failed: the group may still hold it
                return False
        return True

    def store(self) -> Any:
        """The process group's rendezvous store, a key-value store every rank of the job reaches
        without a collective (None without a process group, or where torch keeps none)."""
        if self._dist is None:
            return None
        from torch.distributed import distributed_c10d

        try:
            return distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return None

    def settle(self, name: str, deadline_s: float) -> None:
        """Wait (on the rendezvous store, not gloo) until every rank of the job has reached
        `name`, or until `deadline_s` (`time.monotonic()`). After the last collective at close:
        a rank whose gloo peers are still inside that collective must not exit under them."""
        if self._dist is None:
            return
        store = self.store()
        if store is None:
            return
        key = f"perseus-ext/{name}"
        store.add(key, 1)
        while store.add(key, 0) < len(self.members) and time.monotonic() < deadline_s:
            time.sleep(0.005)


def check_pipeline_rank(pp_group: Any, stage: int) -> None:
    """The pipeline group's ranks must be ordered by stage (what the plan's stage index means)."""
    if pp_group is None:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank(pp_group) != stage:
        from perseus_ext.errors import PerseusError

        raise PerseusError(f"stage {stage} is rank {dist.get_rank(pp_group)} of its pipeline group; "
                           f"perseus-ext expects pipeline-group ranks ordered by stage")


class Pending:
    """A collective started on a gloo group; `result()` waits for it (at most the group's
    timeout, then raises like a blocking collective) and returns its values."""

    def __init__(self, values: Any, work: Any = None) -> None:
        self._values = values  # a list, or the tensor the collective writes into
        self._work = work

    def result(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._values.tolist() if hasattr(self._values, "tolist") else list(self._values)


class ExchangeResult(NamedTuple):
    """What one straggler check tells every rank (seconds of compute per iteration): this
    pipeline's time (None: no measurement yet), the fastest and the slowest pipeline's, the
    largest slowdown announced anywhere, as a factor of the normal time and as a time (0: none),
    and the largest iteration-to-iteration spread of a wait at the gradient sync among this
    pipeline's ranks (seconds; what a recovery verdict between checks must stand out of)."""

    mine_s: float | None
    fastest_s: float
    slowest_s: float
    announced_factor: float
    announced_time_s: float
    wait_noise_s: float = 0.0


class StragglerExchange:
    """One straggler check as two reductions that each run between two iteration boundaries.

    Boundary n starts the element-wise max within the pipeline (own time, announced factor,
    announced time, own wait noise); `advance()` at n + 1 collects it (the pipeline's time is
    its slowest stage's, its wait noise its noisiest rank's) and starts the max among the DP
    peers of (pipeline time, -pipeline time, announcements); `advance()` at n + 2 returns (this
    pipeline's time, the fastest pipeline's, the slowest one's, the largest announced factor,
    the largest announced time, the pipeline's wait noise). Every rank
    advances at the same boundaries, so all issue the same collectives in the same order and
    no agreement on "which iteration does the answer belong to" is needed. A pipeline whose
    ranks have no measurement yet is left out (its time is None when it is this one)."""

    MISSING = -math.inf

    def __init__(self, comm: ControlPlane, own_s: float | None, announced_factor: float,
                 announced_time_s: float, wait_noise_s: float = 0.0) -> None:
        self._comm = comm
        own = self.MISSING if own_s is None else own_s
        self._pending = comm.start_max("pipeline", [own, announced_factor, announced_time_s, wait_noise_s])
        self._pipeline_time: float | None = None
        self._wait_noise_s = 0.0

    def advance(self) -> ExchangeResult | None:
        """The next step; the check's result after the second call, None before."""
        if self._pipeline_time is None:
            mine, factor, time_s, self._wait_noise_s = self._pending.result()
            self._pipeline_time = mine
            self._pending = self._comm.start_max(
                "peers", [mine, -mine if mine != self.MISSING else self.MISSING, factor, time_s])
            return None
        job = self._pending.result()
        mine = self._pipeline_time
        return ExchangeResult(None if mine == self.MISSING else mine, -job[1], job[0], job[2], job[3],
                              self._wait_noise_s)
