"""Solver options with their bounds, and what a solve will cost before it allocates anything.

`SolverOptions` checks every field when it is built, so a config layer rejects a bad value at
the door with the field's name and the allowed range. `check_problem_size` estimates peak
memory and time from the problem size (computations x grid deadlines) and refuses a solve that
would not fit, naming the option to change; a profile in milliseconds instead of seconds (a
1000 x longer frontier, so a 1000 x larger grid) is the usual cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from perseus_ext.errors import SolverError

# Calibrated on the GPT-3 A100 profile (8 x 96 and 16 x 128, benchmarks/scale.py), per
# (computation, grid deadline up to the all-slowest plan): the int16 candidate pool and the
# blocked passes peak at ~30-40 bytes; the passes take ~0.5 us of CPU. Each LP anchor's
# re-solve grows with the square of the computations (~10 ms at 1,536, ~70 ms at 4,096).
BYTES_PER_NODE_DEADLINE = 48
BYTES_PER_NODE = 4096  # DAG, option tables and the schedule's Python objects
BASE_BYTES = 64 * 2**20
SECONDS_PER_NODE_DEADLINE = 0.5e-6
SECONDS_PER_ANCHOR_NODE2 = 4.2e-9

# field: (lowest, highest) allowed value
BOUNDS: dict[str, tuple[float, float]] = {
    "resolution": (1e-6, 10.0),
    "grid_oversampling": (1, 16),
    "min_grid_points": (2, 20_000),
    "anchors": (2, 4096),
    "anchor_budget": (0, 1_000_000),
    "polish_budget": (0, 10**12),
    "gap_polish_budget": (0, 10**12),
    "max_memory_gib": (0.1, 1024.0),
    "max_seconds": (1.0, 7 * 86400.0),
}


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the solver; the defaults meet the quality/speed targets in docs/solver.md."""

    resolution: float = 1e-3  # seconds between grid deadlines (and between gap-search deadlines)
    grid_oversampling: int = 1  # grid deadlines per `resolution` (finer grid, denser frontier)
    min_grid_points: int = 500  # short frontiers get a finer grid than `resolution`
    anchors: int = 256  # LP anchors from T_min to all-slowest (the walk stops past min energy)
    anchor_budget: int = 4_000  # small pipelines get up to anchor_budget / computations anchors
    progress: bool = False  # show a tqdm bar over the LP anchors
    polish_budget: int = 20_000_000  # max deadlines x (computations x clocks)^2 for the local-search polish
    gap_polish_budget: int = 262_144  # max deadlines x computations^2 for the gap-targeted polish
    max_memory_gib: float = 8.0  # refuse solves estimated to need more memory
    max_seconds: float = 3600.0  # refuse solves estimated to take longer (CPU seconds)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `SolverError` naming the first field outside its type or bounds."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "progress":
                if not isinstance(value, bool):
                    raise SolverError(f"solver option progress must be true or false, got {value!r}")
                continue
            low, high = BOUNDS[f.name]
            integral = isinstance(f.default, int)
            kind = "an integer" if integral else "a number"
            ok_type = isinstance(value, int) if integral else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok_type or not (
                math.isfinite(value) and low <= value <= high
            ):
                raise SolverError(
                    f"solver option {f.name} must be {kind} in [{low:g}, {high:g}], got {value!r}; "
                    f"the default is {f.default!r}"
                )


def estimate_cost(num_nodes: int, grid_points: int, anchors: int) -> tuple[float, float]:
    """(peak bytes, CPU seconds) a solve of this size is expected to take."""
    pairs = float(num_nodes) * grid_points
    memory = BASE_BYTES + BYTES_PER_NODE * num_nodes + BYTES_PER_NODE_DEADLINE * pairs
    seconds = SECONDS_PER_NODE_DEADLINE * pairs + SECONDS_PER_ANCHOR_NODE2 * anchors * float(num_nodes) ** 2
    return memory, seconds


def check_problem_size(
    options: SolverOptions, num_nodes: int, grid_points: int, anchors: int, span_s: float | None = None
) -> None:
    """Refuse a solve whose estimate exceeds `max_memory_gib` or `max_seconds`.

    `span_s` (T_slowest - T_min) is None before the DAG exists: then `grid_points` is the least
    the grid can have (`min_grid_points`) and only the size of the pipeline is judged.
    """
    memory, seconds = estimate_cost(num_nodes, grid_points, anchors)
    if memory <= options.max_memory_gib * 2**30 and seconds <= options.max_seconds:
        return
    need = f"~{memory / 2**30:.1f} GiB and ~{seconds:,.0f} s"
    size = f"{num_nodes:,} computations x {grid_points:,} grid deadlines"
    if span_s is None:
        fix = (
            "plan fewer microbatches per iteration (the frontier of one iteration repeats), "
            "lower solver option min_grid_points, or raise max_memory_gib / max_seconds"
        )
    else:
        affordable = options.max_memory_gib * 2**30 / (BYTES_PER_NODE_DEADLINE * num_nodes)
        fix = (
            f"raise solver option resolution to at least {span_s / max(affordable, 1):.3g} s "
            f"(now {options.resolution:g} s), or raise max_memory_gib / max_seconds"
        )
        if span_s > 100:
            fix += (
                f"; the frontier spans {span_s:,.0f} s per iteration: profile times must be in "
                "seconds (milliseconds would explain this)"
            )
    raise SolverError(
        f"frontier solve too large: {size} would need {need} (limits: max_memory_gib "
        f"{options.max_memory_gib:g}, max_seconds {options.max_seconds:g}); {fix}"
    )
