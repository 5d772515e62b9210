"""Per-stage time/energy profiles: loading, validation and Pareto filtering.

The on-disk format is the Perseus/Zeus CSV `stage,instruction,frequency,time,energy`
(seconds and joules of one computation at one SM clock in MHz). The profiling pass writes it,
the published profiles use it, and the planner reads it through `Profile`.
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from perseus_ext.errors import ProfileError

logger = logging.getLogger(__name__)

COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
REQUIRED_INSTRUCTIONS = ("forward", "backward")


@dataclass(frozen=True)
class OperatingPoints:
    """Time and energy of one (stage, instruction) at each clock, fastest clock first."""

    frequencies: np.ndarray  # int MHz, descending
    times: np.ndarray  # seconds
    energies: np.ndarray  # joules

    def __len__(self) -> int:
        return len(self.frequencies)

    def index_of(self, frequency: int) -> int:
        hits = np.flatnonzero(self.frequencies == frequency)
        if not hits.size:
            raise KeyError(frequency)
        return int(hits[0])


@dataclass
class Profile:
    """Measured operating points of every (stage, instruction) of a pipeline."""

    points: dict[tuple[int, str], OperatingPoints]
    source: str = "<memory>"
    dropped: list[tuple[int, str, int]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return 1 + max(stage for stage, _ in self.points)

    @property
    def instructions(self) -> list[str]:
        return sorted({instruction for _, instruction in self.points})

    def __getitem__(self, key: tuple[int, str]) -> OperatingPoints:
        try:
            return self.points[key]
        except KeyError:
            raise ProfileError(
                f"{self.source}: no measurements for stage {key[0]} instruction {key[1]!r}"
            ) from None

    @classmethod
    def from_rows(
        cls, rows: Iterable[Mapping[str, object]], source: str = "<memory>", first_row: int = 1
    ) -> "Profile":
        """Build and validate a profile from dict rows with the CSV's columns."""
        seen: dict[tuple[int, str, int], int] = {}
        grouped: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
        for row_number, row in enumerate(rows, start=first_row):
            where = f"{source}, row {row_number}"
            stage = _parse_int(row, "stage", where, minimum=0)
            instruction = str(row.get("instruction") or "").strip()
            if not instruction:
                raise ProfileError(f"{where}: field 'instruction' is empty; use 'forward' or 'backward'")
            frequency = _parse_int(row, "frequency", where, minimum=1)
            time = _parse_float(row, "time", where)
            energy = _parse_float(row, "energy", where)
            key = (stage, instruction, frequency)
            if key in seen:
                raise ProfileError(
                    f"{where}: duplicate of row {seen[key]} (stage {stage}, instruction "
                    f"{instruction!r}, frequency {frequency}); keep one measurement per clock"
                )
            seen[key] = row_number
            grouped.setdefault((stage, instruction), []).append((frequency, time, energy))
        if not grouped:
            raise ProfileError(f"{source}: no measurements; expected columns {','.join(COLUMNS)}")
        points = {
            key: OperatingPoints(
                frequencies=np.array([f for f, _, _ in sorted(rows, reverse=True)], dtype=np.int64),
                times=np.array([t for _, t, _ in sorted(rows, reverse=True)]),
                energies=np.array([e for _, _, e in sorted(rows, reverse=True)]),
            )
            for key, rows in grouped.items()
        }
        profile = cls(points, source)
        profile._check_complete()
        return profile

    def _check_complete(self) -> None:
        stages = range(self.num_stages)
        instructions = sorted(set(self.instructions) | set(REQUIRED_INSTRUCTIONS))
        for stage in stages:
            for instruction in instructions:
                if (stage, instruction) not in self.points:
                    raise ProfileError(
                        f"{self.source}: stage {stage} has no {instruction!r} rows; every stage "
                        f"0..{self.num_stages - 1} needs {', '.join(instructions)} measurements"
                    )
        for stage in stages:
            clocks = {
                instruction: set(self.points[stage, instruction].frequencies.tolist())
                for instruction in instructions
            }
            union = set().union(*clocks.values())
            for instruction, measured in clocks.items():
                missing = sorted(union - measured)
                if missing:
                    raise ProfileError(
                        f"{self.source}: stage {stage} instruction {instruction!r} lacks clock(s) "
                        f"{missing} that other instructions of the stage have; measure them or "
                        f"drop those clocks everywhere"
                    )

    def pareto(self) -> "Profile":
        """Keep, per (stage, instruction), only clocks no other clock beats on both time and energy.

        Measurements are noisy: a lower clock can come out *faster*, or a clock below the
        minimum-energy one costs more energy while also being slower. Such points are never
        worth running, so they are dropped here and the drop is logged.
        """
        filtered: dict[tuple[int, str], OperatingPoints] = {}
        dropped: list[tuple[int, str, int]] = list(self.dropped)
        for key, op in self.points.items():
            order = np.lexsort((op.energies, op.times))  # by time, then energy
            keep = []
            best_energy = math.inf
            for i in order:
                if op.energies[i] < best_energy:
                    keep.append(i)
                    best_energy = op.energies[i]
            keep_set = set(keep)
            lost = [int(op.frequencies[i]) for i in range(len(op)) if i not in keep_set]
            if lost:
                dropped += [(key[0], key[1], f) for f in lost]
                logger.info(
                    "%s: stage %d %s: dropped %d dominated clock(s) %s",
                    self.source, key[0], key[1], len(lost), lost,
                )
            idx = np.array(keep)
            filtered[key] = OperatingPoints(op.frequencies[idx], op.times[idx], op.energies[idx])
        return Profile(filtered, self.source, dropped)

    def scaled(self, time_factor: float = 1.0, energy_factor: float = 1.0) -> "Profile":
        """Scale a profiled slice to a larger model (e.g. the paper's time x10, energy x10 x TP)."""
        if time_factor <= 0 or energy_factor <= 0:
            raise ProfileError("profile scale factors must be positive")
        return Profile(
            {
                k: OperatingPoints(op.frequencies, op.times * time_factor, op.energies * energy_factor)
                for k, op in self.points.items()
            },
            self.source,
            list(self.dropped),
        )

    def rows(self) -> list[dict[str, object]]:
        return [
            {"stage": s, "instruction": i, "frequency": int(f), "time": float(t), "energy": float(e)}
            for (s, i), op in sorted(self.points.items())
            for f, t, e in zip(op.frequencies, op.times, op.energies)
        ]

    def save(self, path: str | Path) -> None:
        """Write the profile in the CSV format `load_profile` reads."""
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows())


def load_profile(path: str | Path, pareto: bool = True) -> Profile:
    """Read and validate a profile CSV; by default drop dominated clocks (logged)."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file")
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header = [name.strip() for name in (reader.fieldnames or [])]
        unknown = [name for name in header if name not in COLUMNS]
        missing = [name for name in COLUMNS if name not in header]
        if unknown:
            raise ProfileError(
                f"{path}, row 1: unknown column(s) {unknown}; the header must be {','.join(COLUMNS)}"
            )
        if missing:
            raise ProfileError(
                f"{path}, row 1: missing column(s) {missing}; the header must be {','.join(COLUMNS)}"
            )
        rows = [{k.strip(): v for k, v in row.items()} for row in reader]
    profile = Profile.from_rows(rows, source=str(path), first_row=2)
    return profile.pareto() if pareto else profile


def _parse_int(row: Mapping[str, object], name: str, where: str, minimum: int) -> int:
    raw = row.get(name)
    try:
        value = int(str(raw).strip())
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: field {name!r} is {raw!r}; it must be an integer") from None
    if value < minimum:
        raise ProfileError(f"{where}: field {name!r} is {value}; it must be >= {minimum}")
    return value


def _parse_float(row: Mapping[str, object], name: str, where: str) -> float:
    raw = row.get(name)
    try:
        value = float(str(raw).strip())
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: field {name!r} is {raw!r}; it must be a number") from None
    if not math.isfinite(value) or value <= 0:
        unit = "seconds" if name == "time" else "joules"
        raise ProfileError(
            f"{where}: field {name!r} is {raw!r}; it must be a finite positive number of {unit}"
        )
    return value
