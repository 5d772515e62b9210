"""The parallel layout of an emulated job and how a profiled slice maps onto it."""

from __future__ import annotations

from dataclasses import dataclass, field

from perseus_ext.errors import ConfigError
from perseus_ext.planning.energy import resolve_blocking_power  # noqa: F401 (re-exported by perseus_ext.emulator)
from perseus_ext.planning.schedule import PipelineSchedule, ScheduleKind, build_schedule


@dataclass(frozen=True)
class JobLayout:
    """TP x PP x DP training job running one pipeline schedule per data-parallel replica.

    The data-parallel degree follows from the batch: every pipeline runs `microbatches`
    microbatches of `microbatch_size` samples per iteration, so
    DP = global_batch / (microbatches x microbatch_size).
    """

    tensor_parallel: int
    pipeline_parallel: int
    global_batch: int
    microbatches: int
    microbatch_size: int = 1
    schedule: str = ScheduleKind.ONE_F_ONE_B.value
    chunks: int = 1  # model chunks per stage (virtual stages) of interleaved and combined_1f1b
    # The action list of a schedule built elsewhere: a framework's own order (torch's zero-bubble
    # and DualPipeV classes, `adapters.torch_pipelining_orders.torch_schedule`), which the
    # planner does not produce by name. None: `schedule` is built by name.
    actions: PipelineSchedule | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel", "pipeline_parallel", "global_batch", "microbatches",
            "microbatch_size", "chunks",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"job layout: {name} must be a positive integer, got {value!r}")
        per_pipeline = self.microbatches * self.microbatch_size
        if self.global_batch % per_pipeline:
            raise ConfigError(
                f"job layout: global batch {self.global_batch} is not a multiple of microbatches "
                f"x microbatch size = {self.microbatches} x {self.microbatch_size} = "
                f"{per_pipeline}; pick a global batch that every data-parallel pipeline can split "
                f"evenly"
            )
        if self.actions is not None:
            built = (self.actions.kind.value, self.actions.num_stages, self.actions.num_microbatches,
                     self.actions.num_chunks)
            asked = (str(self.schedule), self.pipeline_parallel, self.microbatches, self.chunks)
            if built != asked:
                raise ConfigError(
                    f"job layout: the action list is a {built[0]} schedule of {built[1]} stages, {built[2]} "
                    f"microbatches and {built[3]} chunks per stage, but the layout asks for {asked[0]} with "
                    f"{asked[1]}, {asked[2]} and {asked[3]}; build the actions for this layout"
                )

    @property
    def data_parallel(self) -> int:
        return self.global_batch // (self.microbatches * self.microbatch_size)

    @property
    def gpus_per_pipeline(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def num_gpus(self) -> int:
        return self.data_parallel * self.gpus_per_pipeline

    def build_schedule(self) -> PipelineSchedule:
        """The per-stage orders one pipeline runs: the given action list, or the schedule the
        planner builds by name (1f1b, interleaved, combined_1f1b)."""
        if self.actions is not None:
            return self.actions
        return build_schedule(self.schedule, self.pipeline_parallel, self.microbatches, self.chunks)

    def describe(self) -> dict:
        return {
            "tp": self.tensor_parallel,
            "pp": self.pipeline_parallel,
            "dp": self.data_parallel,
            "gpus": self.num_gpus,
            "global_batch": self.global_batch,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "schedule": self.schedule,
            "chunks": self.chunks,
        }
