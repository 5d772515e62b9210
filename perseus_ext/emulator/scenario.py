"""Straggler scenarios: how much slower than the rest one data-parallel pipeline runs.

A slowdown factor f = T'/T makes one pipeline (the straggler) take T' = f x T_fastest per
iteration, T_fastest being the planner's fastest iteration time. The cause is outside the
pipeline's own clocks (a throttled or slower node, a congested link), so T' does not depend on
the straggler's frequency plan. A scenario is a weighted set of factors: one factor for a
steady straggler, or the share of iterations spent at each slowdown over a run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from perseus_ext.errors import ConfigError
from perseus_ext.inputs import InputError

MAX_SLOWDOWN = 100.0  # a pipeline 100 x slower than the rest is down, not straggling


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
        for factor, weight in pairs.items():
            if not math.isfinite(factor) or not 1.0 <= factor <= MAX_SLOWDOWN:
                raise ConfigError(f"slowdown factor T'/T must be from 1.0 (no straggler) to {MAX_SLOWDOWN:g}, "
                                  f"got {factor:g}")
            if not math.isfinite(weight) or weight < 0:
                raise ConfigError(f"slowdown weight of factor {factor:g} must be a finite non-negative number, "
                                  f"got {weight:g}")
        largest = max(pairs.values(), default=0.0)
        if largest <= 0:
            raise ConfigError("slowdown weights must have a positive sum")
        scaled = {factor: weight / largest for factor, weight in pairs.items()}  # no overflow in the sum
        total = sum(scaled.values())
        factors = tuple(sorted(pairs))
        weights = tuple(scaled[f] / total for f in factors)
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
            if not math.isfinite(key) or not math.isfinite(value):
                raise ConfigError(f"slowdown distribution item {item!r} is not finite; write e.g. '1.0:0.9,1.2:0.1'")
            pairs[key] = pairs.get(key, 0.0) + value
        if not pairs:
            raise ConfigError("slowdown distribution is empty; write e.g. '1.0:0.9,1.2:0.1'")
        return cls.distribution(pairs)

    @classmethod
    def from_trace(cls, path: str | Path) -> "StragglerScenario":
        """A per-iteration trace: a CSV whose column `slowdown` (or single column) holds T'/T,
        read one line at a time (size and line length bounded, blank lines skipped); a bad
        value is an `InputError` naming the file, the line and the column."""
        from perseus_ext.inputs import TABLE_LIMIT_BYTES, check_file, csv_cells, finite_number, iter_lines

        fix = "give a CSV of per-iteration slowdowns T'/T (a 'slowdown' column, or one number per line)"
        check_file(path, what="slowdown trace", limit_bytes=TABLE_LIMIT_BYTES, fix=fix)
        counts: Counter[float] = Counter()
        column: int | None = None
        for number, _, text in iter_lines(path, what="slowdown trace", fix=fix):
            if not text.strip():
                continue
            row = csv_cells(text, path=path, line=number, fix=fix)
            if column is None:  # the first non-blank line: a header, or already a value
                header = [cell.strip().lower() for cell in row]
                column = header.index("slowdown") if "slowdown" in header else 0
                if "slowdown" in header or not _is_number(row[0] if row else ""):
                    continue
            if len(row) <= column or not row[column].strip():
                raise InputError(path, f"the row has no value in column {column + 1}", fix, line=number,
                                 field="slowdown")
            counts[finite_number(row[column], path=path, line=number, field="slowdown", fix=fix, minimum=1.0,
                                 maximum=MAX_SLOWDOWN)] += 1
        if not counts:
            raise InputError(path, "the slowdown trace has no values", fix)
        return cls.distribution(dict(counts), name=f"trace {Path(path).name} ({sum(counts.values())} it.)")

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
