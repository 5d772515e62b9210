"""perseus-ext's figures in Megatron-LM's iteration log line, when the user asks for them.

Megatron-LM prints one line per `--log-interval` on the last rank (`training_log`, through
`megatron.training.training.print_rank_last`), e.g. ` [...] iteration 10/ 100 | ... | energy per
GPU (J/iter/GPU): ... |` with `--log-energy`. With `install(..., iteration_log=True)` the adapter wraps
that printer: a line of that shape gets perseus-ext's figures for the iterations this rank's device
finished since the previous line (its own GPU's energy and time per iteration, from the device
markers, and the lifecycle phase), so both energy figures stand side by side; every other message
passes unchanged. What each figure counts is in docs/monitoring.md.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Megatron-LM's training_log line: " iteration <n>/<total> |" (right-aligned numbers).
ITERATION_LINE = re.compile(r"\biteration\s+\d+/\s*\d+\s*\|")
PRINTER_MODULE, PRINTER = "megatron.training.training", "print_rank_last"


@dataclass(frozen=True)
class LogFields:
    """perseus-ext's figures over the iterations recorded since the previous line."""

    iterations: int
    energy_j_per_iteration: float | None  # this rank's GPU, iteration start to end markers
    time_s_per_iteration: float | None
    phase: str | None  # the lifecycle phase of the latest (observability.phase.Phase's value)

    @classmethod
    def of(cls, records: Sequence[Any]) -> LogFields:
        energies = [record.energy_j for record in records if record.energy_j is not None]
        times = [record.time_s for record in records]
        return cls(len(records), sum(energies) / len(energies) if energies else None,
                   sum(times) / len(times) if times else None,
                   records[-1].phase.value if records else None)

    def text(self) -> str:
        """` perseus energy this GPU (J/iter): 107.9 | perseus time (s/iter): 0.301 | perseus
        phase: deployed |` (n/a where no iteration was recorded since the previous line)."""
        energy = "n/a" if self.energy_j_per_iteration is None else f"{self.energy_j_per_iteration:.1f}"
        seconds = "n/a" if self.time_s_per_iteration is None else f"{self.time_s_per_iteration:.3f}"
        return (f" perseus energy this GPU (J/iter): {energy} | perseus time (s/iter): {seconds} |"
                f" perseus phase: {self.phase or 'n/a'} |")


class IterationLineAppender:
    """A drop-in for Megatron-LM's line printer that appends `LogFields` to its iteration lines.
    `history()` returns the rank's device records so far (the runtime's history, which grows);
    each line reports those added since the previous one."""

    def __init__(self, printer: Callable[..., Any], history: Callable[[], Sequence[Any]]) -> None:
        self.printer = printer
        self._history = history
        self._reported = 0

    def fields(self) -> LogFields:
        records = list(self._history())
        fresh, self._reported = records[self._reported:], len(records)
        return LogFields.of(fresh)

    def __call__(self, message: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, str) and ITERATION_LINE.search(message):
            message = message.rstrip("\n") + self.fields().text()
        return self.printer(message, *args, **kwargs)


def wrap_iteration_lines(history: Callable[[], Sequence[Any]]) -> Callable[[], None] | None:
    """Put an `IterationLineAppender` in place of Megatron-LM's `print_rank_last` (None when
    Megatron-LM's training module is not installed: megatron-core alone prints no such line);
    returns the function that puts the original back."""
    try:
        module = importlib.import_module(PRINTER_MODULE)
    except ImportError:
        return None
    original = getattr(module, PRINTER)
    setattr(module, PRINTER, IterationLineAppender(original, history))

    def restore() -> None:
        setattr(module, PRINTER, original)

    return restore
