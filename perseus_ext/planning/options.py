"""Solver options with their bounds, and what a solve will cost before it allocates anything.

`SolverOptions` checks every field when it is built, so a config layer rejects a bad value at
the door with the field's name and the allowed range. `check_problem_size` estimates peak
memory and time from the problem size (computations x grid deadlines) and refuses a solve that
would not fit, naming the option to change; a profile in milliseconds instead of seconds (a
1000 x longer frontier, so a 1000 x larger grid) is the usual cause. `ClockBudget` is the
clock-change budget two of the options set (`planning/clock_budget.py` plans within it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

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
    "max_clock_changes_per_s": (0.0, 1000.0),
    "min_clock_hold_s": (0.0, 60.0),
    "power_swing_cap": (0.0, 1.0),
}

# The clock-change budget's default: at most this many changes per second per GPU (a clock held
# at least 1 / this long). NCCL collectives were reported to stall with a locked-clock change
# about every 50 ms (20 changes a second) and not with a fixed clock; 5 a second is 4x under
# that rate and costs little energy on the published profiles (docs/solver.md, "Clock-change
# budget").
DEFAULT_MAX_CLOCK_CHANGES_PER_S = 5.0


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
    # Clock-change budget per GPU (`clock_budget`): at most this many changes in any 1 s window
    # (0: no limit), and no clock held shorter than `min_clock_hold_s` (0: no minimum).
    max_clock_changes_per_s: float = DEFAULT_MAX_CLOCK_CHANGES_PER_S
    min_clock_hold_s: float = 0.0
    # Swing cap (`swing_cap.py`): every plan's pipeline power swing at most this fraction of the
    # all-max-clock plan's, dummy work at fill/drain counted in its energy (0: no cap).
    power_swing_cap: float = 0.0

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

    def for_time_scale(self, time_scale: float) -> "SolverOptions":
        """These options for a profile whose times are the real ones divided by `time_scale`
        (the emulator solves a profiled slice of a `time_scale` times longer stage): the
        clock-change budget in the slice's seconds, so its runs last as long in real time."""
        high_rate, high_hold = BOUNDS["max_clock_changes_per_s"][1], BOUNDS["min_clock_hold_s"][1]
        return replace(self, max_clock_changes_per_s=min(self.max_clock_changes_per_s * time_scale, high_rate),
                       min_clock_hold_s=min(self.min_clock_hold_s / time_scale, high_hold))

    @property
    def clock_budget(self) -> "ClockBudget":
        """The clock-change budget these options ask for (`ClockBudget.unlimited` with both 0)."""
        return ClockBudget(self.max_clock_changes_per_s, self.min_clock_hold_s)


@dataclass(frozen=True)
class ClockBudget:
    """How often a plan may change one GPU's clock, iterations replayed back to back.

    `max_changes_per_s`: at most this many changes in any window [t, t + 1 s) (0: no limit);
    `min_hold_s`: every clock a plan sets stays at least this long before the next change (0:
    no minimum). The planner meets both with one rule, a hold of at least `hold_s` =
    max(min_hold_s, 1 / max_changes_per_s): changes that far apart never put more than
    max_changes_per_s of them in a half-open second. A clock that never changes holds forever.
    """

    max_changes_per_s: float = 0.0
    min_hold_s: float = 0.0

    @property
    def hold_s(self) -> float:
        """The shortest hold the planner allows (0: no budget)."""
        rate = 1.0 / self.max_changes_per_s if self.max_changes_per_s > 0 else 0.0
        return max(self.min_hold_s, rate)

    @property
    def active(self) -> bool:
        return self.hold_s > 0

    def allows(self, changes_per_s: float, shortest_hold_s: float) -> bool:
        """Whether a plan with these figures (`ClockFigures`) keeps the budget."""
        rate_ok = self.max_changes_per_s <= 0 or changes_per_s <= self.max_changes_per_s + 1e-9
        return rate_ok and shortest_hold_s >= self.min_hold_s - 1e-9

    def describe(self) -> str:
        if not self.active:
            return "no clock-change budget"
        parts = []
        if self.max_changes_per_s > 0:
            parts.append(f"at most {self.max_changes_per_s:g} clock changes per s")
        if self.min_hold_s > 0:
            parts.append(f"clocks held at least {self.min_hold_s * 1e3:g} ms")
        return " and ".join(parts)


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
