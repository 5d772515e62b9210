"""Straggler scenarios: how much slower than the rest one data-parallel pipeline runs.

A slowdown factor f = T'/T makes one pipeline (the straggler) take T' = f x T_fastest per
iteration, T_fastest being the planner's fastest iteration time. The cause is outside the
pipeline's own clocks (a throttled or slower node, a congested link), so T' does not depend on
the straggler's frequency plan. A scenario is a weighted set of factors: one factor for a
steady straggler, or the share of iterations spent at each slowdown over a run.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from perseus_ext.errors import ConfigError


@dataclass(frozen=True)
class StragglerScenario:
    """Slowdown factors and the fraction of iterations each one holds (fractions sum to 1)."""

    factors: tuple[float, ...]
    weights: tuple[float, ...]
    name: str

    def __post_init__(self) -> None:
        if not self.factors or len(self.factors) != len(self.weights):
            raise ConfigError("a straggler scenario needs one weight per slowdown factor")
        for f in self.factors:
            if not math.isfinite(f) or f < 1.0:
                raise ConfigError(
                    f"slowdown factor T'/T must be a number >= 1.0 (1.0 = no straggler), got {f!r}"
                )
        if any(not math.isfinite(w) or w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError("slowdown weights must be non-negative numbers with a positive sum")

    @classmethod
    def none(cls) -> "StragglerScenario":
        return cls((1.0,), (1.0,), "no straggler")

    @classmethod
    def fixed(cls, factor: float) -> "StragglerScenario":
        name = "no straggler" if factor == 1.0 else f"T'/T = {factor:g}"
        return cls((float(factor),), (1.0,), name)

    @classmethod
    def distribution(cls, pairs: dict[float, float], name: str | None = None) -> "StragglerScenario":
        """`{factor: weight}`; weights are normalised (counts or probabilities both work)."""
        total = sum(pairs.values())
        factors = tuple(sorted(pairs))
        if total <= 0:
            raise ConfigError("slowdown weights must have a positive sum")
        weights = tuple(pairs[f] / total for f in factors)
        label = name or "mix " + ", ".join(f"{f:g}:{w:.0%}" for f, w in zip(factors, weights))
        return cls(factors, weights, label)

    @classmethod
    def parse(cls, text: str) -> "StragglerScenario":
        """`1.0:0.9,1.2:0.1` (factor:weight pairs) as the CLI takes them."""
        pairs: dict[float, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            factor, sep, weight = item.partition(":")
            try:
                key, value = float(factor), float(weight)
            except ValueError:
                raise ConfigError(
                    f"slowdown distribution item {item!r} is not FACTOR:WEIGHT; write e.g. "
                    f"'1.0:0.9,1.2:0.1'"
                ) from None
            if not sep:
                raise ConfigError(f"slowdown distribution item {item!r} lacks ':WEIGHT'")
            pairs[key] = pairs.get(key, 0.0) + value
        if not pairs:
            raise ConfigError("slowdown distribution is empty; write e.g. '1.0:0.9,1.2:0.1'")
        return cls.distribution(pairs)

    @classmethod
    def from_trace(cls, path: str | Path) -> "StragglerScenario":
        """A per-iteration trace: a CSV whose column `slowdown` (or single column) holds T'/T."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such slowdown trace file")
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
        if not rows:
            raise ConfigError(f"{path}: the slowdown trace is empty")
        header = [h.strip().lower() for h in rows[0]]
        column = header.index("slowdown") if "slowdown" in header else 0
        body = rows[1:] if "slowdown" in header or not _is_number(rows[0][0]) else rows
        counts: Counter[float] = Counter()
        for number, row in enumerate(body, start=len(rows) - len(body) + 1):
            if not row or not row[column].strip():
                continue
            try:
                counts[float(row[column])] += 1
            except ValueError:
                raise ConfigError(
                    f"{path}, row {number}: slowdown {row[column]!r} is not a number"
                ) from None
        if not counts:
            raise ConfigError(f"{path}: the slowdown trace has no values")
        return cls.distribution(dict(counts), name=f"trace {path.name} ({sum(counts.values())} it.)")

    @property
    def is_steady(self) -> bool:
        """One slowdown for the whole run."""
        return len(self.factors) == 1

    def describe(self) -> dict:
        return {"name": self.name, "factors": list(self.factors), "weights": list(self.weights)}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
