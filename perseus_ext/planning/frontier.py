"""Plans and the iteration time–energy frontier: the planner's output, read by the runtime,
the straggler policy, the emulator and the CLI.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from perseus_ext.errors import ScheduleError, SolverError
from perseus_ext.planning.schedule import ScheduleSummary


@dataclass(frozen=True)
class ClockFigures:
    """How often a plan changes clocks, its iterations replayed back to back
    (`clock_budget.clock_figures`): the most changes any one GPU makes in a window [t, t + 1 s),
    and the shortest time any GPU holds a clock between two changes (inf: no GPU ever
    changes its clock)."""

    changes_per_s: float
    shortest_hold_s: float

    def to_dict(self) -> dict:
        hold = None if math.isinf(self.shortest_hold_s) else self.shortest_hold_s
        return {"changes_per_s": self.changes_per_s, "shortest_hold_s": hold}

    @classmethod
    def from_dict(cls, data: dict) -> "ClockFigures":
        hold = data.get("shortest_hold_s")
        return cls(float(data["changes_per_s"]), math.inf if hold is None else float(hold))


@dataclass(frozen=True, eq=False)
class Plan:
    """One SM clock per computation, with the iteration time and energy of replaying it.

    `frequencies[s]` holds stage s's clocks (MHz) in that stage's execution order, so a stage
    only needs its own row to drive its GPU. It is a read-only int32 array of shape
    (stages, computations per stage): thousands of plans of thousands of computations stay
    small and are often views into one array shared by a whole frontier. Where stages run
    different numbers of computations (combined units, an asymmetric layout), shorter rows end
    in zeros, which are no clock (`for_stage` leaves them out).
    """

    time: float  # seconds: longest path of the DAG with the profiled times
    energy: float  # joules: computation + blocking energy of every stage
    frequencies: np.ndarray
    clock: ClockFigures | None = None  # how often it changes clocks (None: not computed)

    def __post_init__(self) -> None:
        freqs = np.asarray(self.frequencies, dtype=np.int32)
        if freqs.ndim != 2:
            raise SolverError("plan frequencies must be a (stages, computations) table")
        if freqs.flags.writeable:
            freqs = freqs.copy() if freqs is self.frequencies else freqs
            freqs.flags.writeable = False
        object.__setattr__(self, "frequencies", freqs)

    def for_stage(self, stage: int) -> list[int]:
        """Stage `stage`'s clocks as plain ints, in its execution order."""
        row = self.frequencies[stage]
        if len(row) and not row[-1]:
            row = row[: int(np.count_nonzero(row))]
        return row.tolist()

    def to_dict(self) -> dict:
        clock = {} if self.clock is None else {"clock": self.clock.to_dict()}
        return {"time": self.time, "energy": self.energy, "frequencies": self.frequencies.tolist(), **clock}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        clock = data.get("clock")
        return cls(float(data["time"]), float(data["energy"]), np.array(data["frequencies"]),
                   None if clock is None else ClockFigures.from_dict(clock))


@dataclass(frozen=True)
class Frontier:
    """Pareto-optimal plans ordered by time: each is faster *or* cheaper than every other
    (times strictly increase, energies strictly decrease).

    `baseline` is every computation at its fastest clock (what training runs without
    perseus-ext), replayed with the same energy model.

    A wait-aware frontier (`planning/wait_aware.py`) appends, from `extension_start` on, plans
    slower than the minimum-energy plan: worth running only when the iteration is held to a
    longer time anyway (a straggler), as they are Pareto-optimal in (time, energy - blocking
    power x stages x time). `ordinary_plans`, `min_energy` and `plan_for_deadline` ignore them.
    """

    schedule: ScheduleSummary
    blocking_power: float
    plans: tuple[Plan, ...]
    baseline: Plan
    extension_start: int | None = None  # index of the first wait-aware plan; None: no extension

    def __post_init__(self) -> None:
        if not self.plans:
            raise SolverError("a frontier needs at least one plan")
        start = self.extension_start
        if start is not None and not 1 <= start <= len(self.plans):
            raise SolverError(
                f"extension_start must be between 1 and {len(self.plans)} plans, got {start!r}"
            )

    @property
    def ordinary_plans(self) -> tuple[Plan, ...]:
        """The plans up to the minimum-energy one, each chosen by its own iteration time."""
        return self.plans if self.extension_start is None else self.plans[: self.extension_start]

    @property
    def fastest(self) -> Plan:
        """The intrinsic-bloat plan: as fast as all-max-clock, least energy at that speed."""
        return self.plans[0]

    @property
    def min_energy(self) -> Plan:
        return min(self.ordinary_plans, key=lambda p: p.energy)

    def plan_for_deadline(self, deadline: float) -> Plan:
        """Lowest-energy plan that finishes within `deadline`; the fastest plan if none does.

        This is the straggler policy's lookup: a non-straggler pipeline slows down to just meet
        the straggler's iteration time, and never past the minimum-energy point.
        """
        best = self.fastest
        for plan in self.ordinary_plans:
            if plan.time <= deadline and plan.energy < best.energy:
                best = plan
        return best

    def intrinsic_saving(self) -> float:
        """Fraction of the all-max-clock energy the fastest plan saves at no slowdown."""
        return 1.0 - self.fastest.energy / self.baseline.energy

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule.to_dict(),
            "blocking_power": self.blocking_power,
            "baseline": self.baseline.to_dict(),
            "plans": [p.to_dict() for p in self.plans],
            **self._extension_dict(),
        }

    def _extension_dict(self) -> dict:
        return {} if self.extension_start is None else {"extension_start": self.extension_start}

    @classmethod
    def from_dict(cls, data: dict) -> "Frontier":
        start = data.get("extension_start")
        return cls(
            schedule=ScheduleSummary.from_dict(data["schedule"]),
            blocking_power=float(data["blocking_power"]),
            plans=tuple(Plan.from_dict(p) for p in data["plans"]),
            baseline=Plan.from_dict(data["baseline"]),
            extension_start=None if start is None else int(start),
        )

    def save(self, path: str | Path) -> None:
        """Write `to_dict()`'s JSON; with orjson the clock tables go out as numpy, no lists."""
        try:
            import orjson
        except ImportError:
            Path(path).write_text(json.dumps(self.to_dict()))
            return
        data = {
            "schedule": self.schedule.to_dict(),
            "blocking_power": self.blocking_power,
            "baseline": _plan_json(self.baseline),
            "plans": [_plan_json(p) for p in self.plans],
            **self._extension_dict(),
        }
        Path(path).write_bytes(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY))

    @classmethod
    def load(cls, path: str | Path) -> "Frontier":
        """A frontier file (`perseus.frontier_path`, `perseus-ext frontier -o`), size-capped and
        checked field by field: a bad one is an `InputError` naming the file and the field."""
        from perseus_ext.inputs import FRONTIER_LIMIT_BYTES, parse_json, read_bytes, require_object

        what, fix = "frontier file", FRONTIER_FIX
        data = parse_json(read_bytes(path, what=what, limit_bytes=FRONTIER_LIMIT_BYTES, fix=fix), path=path,
                          what=what, fix=fix, max_depth=8, duplicates=True)
        data = require_object(data, path=path, what=what, fix=fix)
        schedule = require_object(_field(data, "schedule", path), path=path, what=what, fix=fix, field="schedule")
        plans = _field(data, "plans", path)
        if not isinstance(plans, list) or not plans:
            raise _bad(path, "plans", "must be a non-empty list of plans")
        start = data.get("extension_start")
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                  or not 1 <= start <= len(plans)):
            raise _bad(path, "extension_start", f"must be an integer from 1 to {len(plans)}, got {start!r}")
        baseline = _plan(_field(data, "baseline", path), path, "baseline")
        if baseline.energy <= 0:
            raise _bad(path, "baseline.energy", f"must be positive, got {baseline.energy:g}")
        blocking_power = _number(data, "blocking_power", path, "")
        checked = tuple(_plan(plan, path, f"plans[{k}]") for k, plan in enumerate(plans))
        return cls(schedule=_schedule(schedule, path), blocking_power=blocking_power, plans=checked,
                   baseline=baseline, extension_start=start)

    def to_compact(
        self, stages: Iterable[int] | None = None, plans: Sequence[int] | None = None
    ) -> dict:
        """The frontier for shipping to ranks: every selected plan's time and energy, and for
        each of `stages` (default all) only its clocks, as changes from plan to plan.

        Neighbouring plans differ in few computations, so a stage's table is its first plan's
        clocks plus, per later plan, the positions that change and their new clocks (int16 MHz;
        `counts[p]` is how many changes plan p brings).
        A rank needs only its own stage, and only the plans (`plans`, frontier indices; default
        all) its policy may select. `compact_stage_clocks` / `from_compact` read it back.
        """
        chosen = np.arange(len(self.plans)) if plans is None else np.asarray(plans, dtype=np.int64)
        if not chosen.size:
            raise SolverError("a compact frontier needs at least one plan")
        stage_ids = range(len(self.baseline.frequencies)) if stages is None else stages
        table = np.stack([self.plans[j].frequencies for j in chosen])  # (plans, stages, per stage)
        per_stage = {}
        for stage in stage_ids:
            length = len(self.baseline.for_stage(stage))  # a shorter stage's padding stays home
            clocks = table[:, stage, :length]
            changed = clocks[1:] != clocks[:-1]
            plan_of, position = np.nonzero(changed)
            per_stage[int(stage)] = {
                "first": clocks[0].astype(np.int16),
                "baseline": self.baseline.frequencies[stage, :length].astype(np.int16),
                "counts": np.bincount(plan_of + 1, minlength=len(chosen)).astype(np.int32),
                "positions": position.astype(np.int32),
                "clocks": clocks[1:][changed].astype(np.int16),
            }
        return {
            "schedule": self.schedule,
            "blocking_power": self.blocking_power,
            "plan_indices": chosen.astype(np.int32),
            "times": np.array([self.plans[j].time for j in chosen]),
            "energies": np.array([self.plans[j].energy for j in chosen]),
            "baseline": (self.baseline.time, self.baseline.energy),
            "stages": per_stage,
            "extension_start": _selected_extension_start(self.extension_start, chosen),
            "clock_figures": _figures_of([self.plans[j] for j in chosen]),
        }

    def stage_table(self, stage: int) -> StagePlanTable:
        """Stage `stage`'s plan table (every plan's figures, this stage's clocks)."""
        return StagePlanTable(stage, len(self.baseline.frequencies), self.to_compact(stages=[stage]))

    @classmethod
    def from_compact(cls, data: dict) -> "Frontier":
        """The frontier `to_compact` shipped, when it holds every stage."""
        stages = data["stages"]
        if sorted(stages) != list(range(len(stages))):
            raise SolverError(
                f"compact frontier holds stages {sorted(stages)}, not all; read one stage's "
                "clocks with compact_stage_clocks"
            )
        rows = [compact_stage_clocks(data, s) for s in range(len(stages))]
        width = max(row.shape[1] for row in rows)
        table = np.zeros((rows[0].shape[0], len(rows), width), dtype=np.int32)
        baseline = np.zeros((len(rows), width), dtype=np.int32)
        for s, row in enumerate(rows):
            table[:, s, : row.shape[1]] = row
            baseline[s, : row.shape[1]] = stages[s]["baseline"]
        table.flags.writeable = False
        figures = data.get("clock_figures")
        return cls(
            schedule=data["schedule"],
            blocking_power=float(data["blocking_power"]),
            plans=tuple(
                Plan(float(t), float(e), table[j], None if figures is None else ClockFigures(*map(float, figures[j])))
                for j, (t, e) in enumerate(zip(data["times"], data["energies"]))
            ),
            baseline=Plan(float(data["baseline"][0]), float(data["baseline"][1]), baseline),
            extension_start=data.get("extension_start"),
        )


@dataclass(frozen=True, eq=False)
class StagePlanTable:
    """One stage's share of a frontier, the same type on the pipeline leader and on every other
    rank: every plan's time and energy (what policies choose by), the extension start, and this
    stage's clocks, kept as changes from plan to plan (`Frontier.to_compact`) and read with
    `clocks(index)`. The leader builds its own with `Frontier.stage_table`; `runtime/shipping.py`
    sends each other rank its own.
    """

    stage: int
    num_stages: int
    compact: dict  # Frontier.to_compact(stages=[stage]): typed arrays, no "num_stages" key

    @property
    def times(self) -> np.ndarray:
        return self.compact["times"]

    @property
    def energies(self) -> np.ndarray:
        return self.compact["energies"]

    @property
    def extension_start(self) -> int | None:
        return self.compact["extension_start"]

    def clock_figures(self, index: int) -> ClockFigures | None:
        """How often plan `index` changes clocks (None when the frontier did not say)."""
        figures = self.compact.get("clock_figures")
        return None if figures is None else ClockFigures(*map(float, figures[index]))

    def clocks(self, index: int) -> tuple[int, ...]:
        """This stage's clocks under plan `index`, in its execution order."""
        return tuple(int(c) for c in self._table[index])

    def __getstate__(self) -> dict:
        """Pickled as shipped: the change-encoded clocks, never the decoded table."""
        return {"stage": self.stage, "num_stages": self.num_stages, "compact": self.compact}

    @cached_property
    def _table(self) -> np.ndarray:
        return compact_stage_clocks(self.compact, self.stage)

    def table(self) -> np.ndarray:
        """(plans, computations) clocks of this stage."""
        return self._table

    def frontier(self) -> Frontier:
        """Every plan's time and energy with no clocks (a (stages, 0) table: policies count
        stages by it), for a rank that holds no other stage's clocks."""
        data = self.compact
        no_clocks = np.zeros((self.num_stages, 0), dtype=np.int32)
        no_clocks.flags.writeable = False
        return Frontier(
            schedule=data["schedule"], blocking_power=float(data["blocking_power"]),
            plans=tuple(Plan(float(t), float(e), no_clocks) for t, e in zip(self.times, self.energies)),
            baseline=Plan(float(data["baseline"][0]), float(data["baseline"][1]), no_clocks),
            extension_start=self.extension_start,
        )


def _figures_of(plans: Sequence[Plan]) -> np.ndarray | None:
    """(plans, 2) changes per s and shortest hold of every plan (float32: figures to report, sent
    to every rank), or None if one lacks them."""
    if any(plan.clock is None for plan in plans):
        return None
    return np.array([(plan.clock.changes_per_s, plan.clock.shortest_hold_s) for plan in plans], dtype=np.float32)


def _selected_extension_start(start: int | None, chosen: np.ndarray) -> int | None:
    """Where the extension starts among the selected plans (None when they are all of one kind)."""
    if start is None:
        return None
    ordinary = int(np.sum(chosen < start))
    return ordinary if 0 < ordinary < len(chosen) else None


def compact_stage_clocks(data: dict, stage: int) -> np.ndarray:
    """(plans, computations of the stage) clocks of one stage from `Frontier.to_compact`."""
    part = data["stages"][stage]
    num_plans, width = len(data["times"]), len(part["first"])
    # Write each change at its plan, then carry every position's last write forward.
    latest = np.full((num_plans, width), -1, dtype=np.int64)
    latest[0] = part["first"]
    plan_of = np.repeat(np.arange(num_plans), part["counts"])
    latest[plan_of, part["positions"]] = part["clocks"]
    source = np.where(latest >= 0, np.arange(num_plans)[:, None], 0)
    np.maximum.accumulate(source, axis=0, out=source)
    return latest[source, np.arange(width)]


FRONTIER_FIX = "give a frontier file perseus-ext wrote (perseus.frontier_path or perseus-ext frontier -o), unchanged"
MAX_CLOCK_MHZ = 100_000


def _bad(path: str | Path, field: str, problem: str) -> Exception:
    from perseus_ext.inputs import InputError

    return InputError(path, problem, FRONTIER_FIX, field=field)


def _field(data: dict, key: str, path: str | Path, prefix: str = "") -> object:
    if key not in data:
        raise _bad(path, prefix + key, "is missing")
    return data[key]


def _number(data: dict, key: str, path: str | Path, prefix: str) -> float:
    from perseus_ext.inputs import json_number

    return float(json_number(_field(data, key, path, prefix), path=path, field=prefix + key, fix=FRONTIER_FIX))


def _schedule(data: dict, path: str | Path) -> ScheduleSummary:
    """A frontier file's schedule: its kind and positive integer sizes."""
    for key in ("stages", "microbatches", "virtual_stages"):
        value = data.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
            raise _bad(path, "schedule." + key, f"must be a positive integer, got {value!r}")
    try:
        return ScheduleSummary.from_dict(data)
    except ScheduleError as err:
        raise _bad(path, "schedule", str(err)) from None


def _plan(data: object, path: str | Path, where: str) -> Plan:
    """One plan of a frontier file: finite, non-negative time and energy, a (stages,
    computations) table of integer clocks."""
    if not isinstance(data, dict):
        raise _bad(path, where, "must be an object with time, energy and frequencies")
    clocks = _field(data, "frequencies", path, where + ".")
    if (not isinstance(clocks, list) or not clocks or not all(isinstance(row, list) for row in clocks)
            or len({len(row) for row in clocks}) != 1):
        raise _bad(path, where + ".frequencies", "must be a (stages x computations) table: a list of equal-length "
                   "lists of clocks in MHz")
    try:
        table = np.array(clocks)
    except (ValueError, OverflowError):
        table = np.array([])
    if table.ndim != 2 or table.dtype.kind not in "iu" or table.min() < 0 or table.max() > MAX_CLOCK_MHZ:
        raise _bad(path, where + ".frequencies", f"must hold integer clocks from 0 to {MAX_CLOCK_MHZ} MHz")
    clock = data.get("clock")
    if clock is not None:
        if not isinstance(clock, dict):
            raise _bad(path, where + ".clock", "must be an object with changes_per_s and shortest_hold_s")
        hold = clock.get("shortest_hold_s")
        clock = ClockFigures(_number(clock, "changes_per_s", path, where + ".clock."),
                             math.inf if hold is None else _number(clock, "shortest_hold_s", path, where + ".clock."))
    return Plan(_number(data, "time", path, where + "."), _number(data, "energy", path, where + "."),
                table.astype(np.int32), clock)


def _plan_json(plan: Plan) -> dict:
    clock = {} if plan.clock is None else {"clock": plan.clock.to_dict()}
    return {"time": plan.time, "energy": plan.energy, "frequencies": plan.frequencies, **clock}
