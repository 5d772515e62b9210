"""One side-by-side comparison job: topology, simulated workload, straggler timeline, variants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VARIANTS = ("disabled", "observe", "perseus", "faulty", "t-star")
# "t-star": perseus whose straggler policy never goes past the minimum-energy plan T* (the
# yardstick of wait-aware plans); "faulty": perseus whose `fault_rank` GPU fails every clock change.
WIDTH = 32  # hidden size of the toy model: tiny, the simulated GPU supplies the compute time


@dataclass
class Scenario:
    """One demo/test job: topology, workload, straggler timeline and which variants to run."""

    out_dir: str
    stages: int = 2
    pipelines: int = 2
    microbatches: int = 4
    iterations: int = 64
    forward_seconds: list[float] = field(default_factory=lambda: [0.010, 0.014])
    backward_seconds: list[float] = field(default_factory=lambda: [0.020, 0.028])
    straggler_pipeline: int | None = 1
    straggler_start: int = 28
    straggler_end: int = 48
    slowdown: float = 1.2
    variants: list[str] = field(default_factory=lambda: ["observe", "perseus"])
    fault_rank: int = 1  # "faulty" variant: this rank's GPU fails every clock change
    perseus: dict[str, Any] = field(default_factory=dict)  # overrides of the perseus section
    deepspeed: dict[str, Any] = field(default_factory=dict)  # more DeepSpeed config (e.g. a monitor)

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; use {', '.join(VARIANTS)}")

    @property
    def world_size(self) -> int:
        return self.stages * self.pipelines

    def perseus_section(self, variant: str) -> dict[str, Any]:
        if variant == "disabled":
            return {"enabled": False}
        section: dict[str, Any] = {
            "enabled": True,
            "gpu": "sim:a100_sxm",
            "warmup_iterations": 2,
            "clock_stride": 6,
            "straggler_check_interval": 2,
            "log_interval": 10,
            "control_timeout_s": 120.0,
            # A coarser grid: the toy frontier solves in ~1 s. No clock-change budget: the toy's
            # 10-30 ms computations would leave one clock per stage under the default 5 changes
            # a second, which real computations (hundreds of ms) keep for free (docs/solver.md).
            "solver": {"min_grid_points": 300, "max_clock_changes_per_s": 0},
            "simulated_workload": {
                "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds,
            },
            "frontier_path": str(Path(self.out_dir) / f"frontier-{variant}.json"),
            "log_path": str(Path(self.out_dir) / f"log-{variant}-{{rank}}.jsonl"),
            "baseline_fraction": 0.25,  # a short demo: enough probes for a usable interval
        }
        section.update(self.perseus)
        if variant == "observe":
            section["mode"] = "observe"
        return section
