"""Plans and the iteration time–energy frontier: the planner's output, read by the runtime,
the straggler policy, the emulator and the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perseus_ext.errors import SolverError


@dataclass(frozen=True, eq=False)
class Plan:
    """One SM clock per computation, with the iteration time and energy of replaying it.

    `frequencies[s]` holds stage s's clocks (MHz) in that stage's execution order, so a stage
    only needs its own row to drive its GPU. It is a read-only int32 array of shape
    (stages, computations per stage): thousands of plans of thousands of computations stay
    small and are often views into one array shared by a whole frontier.
    """

    time: float  # seconds: longest path of the DAG with the profiled times
    energy: float  # joules: computation + blocking energy of every stage
    frequencies: np.ndarray

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
        return self.frequencies[stage].tolist()

    def to_dict(self) -> dict:
        return {"time": self.time, "energy": self.energy, "frequencies": self.frequencies.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        return cls(float(data["time"]), float(data["energy"]), np.array(data["frequencies"]))


@dataclass(frozen=True)
class Frontier:
    """Pareto-optimal plans ordered by time: each is faster *or* cheaper than every other
    (times strictly increase, energies strictly decrease).

    `baseline` is every computation at its fastest clock (what training runs without
    perseus-ext), replayed with the same energy model.
    """

    schedule: dict
    blocking_power: float
    plans: tuple[Plan, ...]
    baseline: Plan

    def __post_init__(self) -> None:
        if not self.plans:
            raise SolverError("a frontier needs at least one plan")

    @property
    def fastest(self) -> Plan:
        """The intrinsic-bloat plan: as fast as all-max-clock, least energy at that speed."""
        return self.plans[0]

    @property
    def min_energy(self) -> Plan:
        return min(self.plans, key=lambda p: p.energy)

    def plan_for_deadline(self, deadline: float) -> Plan:
        """Lowest-energy plan that finishes within `deadline`; the fastest plan if none does.

        This is the straggler policy's lookup: a non-straggler pipeline slows down to just meet
        the straggler's iteration time, and never past the minimum-energy point.
        """
        best = self.fastest
        for plan in self.plans:
            if plan.time <= deadline and plan.energy < best.energy:
                best = plan
        return best

    def intrinsic_saving(self) -> float:
        """Fraction of the all-max-clock energy the fastest plan saves at no slowdown."""
        return 1.0 - self.fastest.energy / self.baseline.energy

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "blocking_power": self.blocking_power,
            "baseline": self.baseline.to_dict(),
            "plans": [p.to_dict() for p in self.plans],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Frontier":
        return cls(
            schedule=dict(data["schedule"]),
            blocking_power=float(data["blocking_power"]),
            plans=tuple(Plan.from_dict(p) for p in data["plans"]),
            baseline=Plan.from_dict(data["baseline"]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "Frontier":
        return cls.from_dict(json.loads(Path(path).read_text()))
