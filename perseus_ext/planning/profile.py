"""Per-stage time/energy profiles: loading, validation and the useful-clock filter.

The on-disk format is the Perseus/Zeus CSV `stage,instruction,frequency,time,energy`
(seconds and joules of one computation at one SM clock in MHz). The profiling pass writes it,
the published profiles use it, and the planner reads it through `Profile`. `instruction` names a
computation kind (`schedule.Kind`): `forward`, `backward`, `input_gradient`,
`weight_gradient`, `combined` or `reduce_grad`. Every stage needs its forward and its gradient
work (`backward`, or `input_gradient` and `weight_gradient`); the other kinds are needed only by
schedules that run them (`derived.py` estimates them from a forward/backward profile).

Profiles come from users, so reading one never ends in a traceback or an unbounded allocation:
the file size, row count, field length, stage count and every number are bounded, and each
error names the file, the row, the field and the fix.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from perseus_ext.errors import ProfileError

logger = logging.getLogger(__name__)

COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
REQUIRED_INSTRUCTIONS = ("forward", "backward")  # what the 1F1B and interleaved schedules run
INSTRUCTIONS = (
    "forward", "backward", "input_gradient", "weight_gradient", "combined", "reduce_grad",
)  # every computation kind a schedule names (`schedule.Kind`)
_SPLIT_GRADIENT = ("input_gradient", "weight_gradient")

# Bounds far above any real pipeline, so that a corrupt or mistyped profile fails at once.
MAX_PROFILE_BYTES = 16 * 1024 * 1024  # far above a real profile (one short row per clock)
MAX_ROWS = 250_000  # 512 stages x 2 instructions x 244 clocks
MAX_FIELD_CHARS = 64
MAX_STAGES = 512
MAX_CLOCK_MHZ = 10_000  # SM clocks of today's GPUs are below 3,000 MHz
MAX_TIME_S = 100.0  # one forward or backward of one microbatch; larger suggests milliseconds
MAX_POWER_W = 50_000.0  # energy / time of one computation (a whole TP group); larger suggests mJ


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
            hint = ""
            if key[1] in INSTRUCTIONS[2:5]:
                hint = ("; measure it, or estimate it from the forward/backward rows with "
                        "planning.derived.derive_kinds")
            raise ProfileError(
                f"{self.source}: no measurements for stage {key[0]} instruction {key[1]!r}{hint}"
            ) from None

    @classmethod
    def from_rows(
        cls, rows: Iterable[Mapping[str, object]], source: str = "<memory>", first_row: int = 1
    ) -> "Profile":
        """Build and validate a profile from dict rows with the CSV's columns."""
        return cls.from_numbered_rows(enumerate(rows, start=first_row), source)

    @classmethod
    def from_numbered_rows(
        cls, rows: Iterable[tuple[int, Mapping[str, object]]], source: str = "<memory>"
    ) -> "Profile":
        """`from_rows` with each row's own number (a file's line, blank lines included)."""
        seen: dict[tuple[int, str, int], int] = {}
        grouped: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
        for count, (row_number, row) in enumerate(rows):
            where = f"{source}, row {row_number}"
            if count >= MAX_ROWS:
                raise ProfileError(f"{where}: more than {MAX_ROWS:,} measurements; is this a profile?")
            stage = _parse_int(row, "stage", where, 0, MAX_STAGES - 1, "pipeline stages are numbered from 0")
            instruction = _parse_instruction(row, where)
            frequency = _parse_int(row, "frequency", where, 1, MAX_CLOCK_MHZ, "an SM clock in MHz")
            time = _parse_float(row, "time", where, MAX_TIME_S, "seconds")
            energy = _parse_float(row, "energy", where, MAX_POWER_W * MAX_TIME_S, "joules")
            if energy / time > MAX_POWER_W:
                raise ProfileError(
                    f"{where}: energy {energy:g} J in {time:g} s is {energy / time:,.0f} W; energy "
                    f"must be joules and time seconds (millijoules? divide energy by 1000)"
                )
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
        points = {}
        for key, measured in grouped.items():
            measured.sort(reverse=True)  # fastest clock first
            points[key] = OperatingPoints(
                frequencies=np.array([f for f, _, _ in measured], dtype=np.int64),
                times=np.array([t for _, t, _ in measured]),
                energies=np.array([e for _, _, e in measured]),
            )
        profile = cls(points, source)
        profile._check_complete()
        return profile

    def _check_complete(self) -> None:
        """Every stage has its forward and its gradient work (`backward`, or `input_gradient`
        and `weight_gradient`), and all instructions of a stage share one set of clocks."""
        stages = range(self.num_stages)
        for stage in stages:
            kinds = {instruction for s, instruction in self.points if s == stage}
            split = all(k in kinds for k in _SPLIT_GRADIENT)
            needed = ("forward",) if split else REQUIRED_INSTRUCTIONS
            for instruction in needed:
                if instruction not in kinds:
                    raise ProfileError(
                        f"{self.source}: stage {stage} has no {instruction!r} rows; every stage "
                        f"0..{self.num_stages - 1} needs forward and backward measurements (or "
                        f"forward, input_gradient and weight_gradient)"
                    )
            clocks = {
                instruction: set(self.points[stage, instruction].frequencies.tolist())
                for instruction in sorted(kinds)
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

    def useful_clocks(self, blocking_power: float) -> "Profile":
        """Keep, per (stage, instruction), only the clocks some plan can gain from: a clock is
        dropped only if another clock of the same computation is no slower and no costlier in
        energy - `blocking_power` x time (the same notion everywhere: `useful_indices`).

        A GPU that finishes a computation early waits at blocking power for the time it saved,
        so on a computation with slack a slower clock that costs a little more energy can still
        be cheaper in total; only clocks beaten on both time and that cost can never help.
        Measurement noise (a lower clock that comes out faster) is dropped by the same rule.
        One INFO line in all, the clocks at DEBUG.
        """
        check_blocking_power(blocking_power)
        filtered: dict[tuple[int, str], OperatingPoints] = {}
        dropped: list[tuple[int, str, int]] = list(self.dropped)
        newly_dropped = 0
        for key, op in self.points.items():
            keep = useful_indices(op.times, op.energies, blocking_power)
            if len(keep) < len(op):
                keep_set = set(keep)
                lost = [int(op.frequencies[i]) for i in range(len(op)) if i not in keep_set]
                dropped += [(key[0], key[1], f) for f in lost]
                newly_dropped += len(lost)
                logger.debug(
                    "%s: stage %d %s: dropped %d clock(s) %s", self.source, key[0], key[1], len(lost), lost,
                )
            idx = np.array(keep)
            filtered[key] = OperatingPoints(op.frequencies[idx], op.times[idx], op.energies[idx])
        if newly_dropped:
            total = sum(len(op) for op in self.points.values())
            logger.info(
                "%s: %d of %d clock measurements useful at blocking power %g W; dropped %d (another "
                "clock of the same computation is no slower and no costlier in energy - blocking "
                "power x time); -v lists them",
                self.source, total - newly_dropped, total, blocking_power, newly_dropped,
            )
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


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile CSV, every measured clock kept (the planner keeps the
    useful ones, `Profile.useful_clocks`, once it knows the blocking power)."""
    path = Path(path)
    rows = _read_rows(path)
    header = [name.strip() for name in rows[0]]
    _check_header(header, path)
    body = []
    for row_number, row in enumerate(rows[1:], start=2):
        if not any(field.strip() for field in row):
            continue  # blank line
        if len(row) != len(header):
            raise ProfileError(
                f"{path}, row {row_number}: {len(row)} field(s) but the header has {len(header)} "
                f"({','.join(header)}); quote fields that contain commas"
            )
        body.append((row_number, dict(zip(header, row))))
    if not body:
        raise ProfileError(f"{path}: no measurements after the header; add rows {','.join(COLUMNS)}")
    return Profile.from_numbered_rows(body, source=str(path))


def useful_indices(
    times: np.ndarray, energies: np.ndarray, blocking_power: float, never_slack: bool = False
) -> list[int]:
    """Indices of a computation's useful clocks, by increasing time: those no other clock beats
    on both time and energy - `blocking_power` x time (what the clock costs over the iteration
    when the computation has slack). `never_slack`: the computation is on every path of the
    iteration, so any time it saves shortens the iteration: a clock must also be cheaper in
    energy than every faster one."""
    keep = pareto_indices(times, energies - blocking_power * times)
    if never_slack:
        keep = [keep[i] for i in pareto_indices(times[keep], energies[keep])]
    return keep


def check_blocking_power(blocking_power: float) -> None:
    if not np.isfinite(blocking_power) or blocking_power < 0:
        raise ProfileError(
            f"blocking power must be a non-negative number of watts, got {blocking_power!r}"
        )


def pareto_indices(times: np.ndarray, energies: np.ndarray, tolerance: float = 0.0) -> list[int]:
    """Indices of the (time, energy) points no other point beats on both, by increasing time;
    a point must save more than `tolerance` energy over every faster one to be kept."""
    order = np.lexsort((energies, times))  # by time, then energy
    ordered = energies[order]
    # A kept point is cheaper than every point before it: only those need the loop.
    improves = ordered < np.minimum.accumulate(np.r_[np.inf, ordered[:-1]])
    keep: list[int] = []
    best = math.inf
    for i, energy in zip(order[improves].tolist(), ordered[improves].tolist()):
        if energy < best - tolerance:
            keep.append(i)
            best = energy
    return keep


def _read_rows(path: Path) -> list[list[str]]:
    """The CSV's rows, read with bounded memory and as UTF-8 text (a BOM is allowed)."""
    try:
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file" if not path.exists()
                               else f"{path}: not a regular file; give a profile CSV")
        with open(path, "rb") as fh:
            data = fh.read(MAX_PROFILE_BYTES + 1)
    except OSError as err:
        raise ProfileError(f"{path}: cannot read the profile ({err.strerror})") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ProfileError(
            f"{path}: larger than {MAX_PROFILE_BYTES // (1024 * 1024)} MiB; a profile has one short "
            f"row per (stage, instruction, clock): is this the right file?"
        )
    if b"\0" in data:
        raise ProfileError(f"{path}: binary data (NUL bytes); a profile is a text CSV file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ProfileError(
            f"{path}, row {line}: byte 0x{data[err.start]:02x} is not UTF-8 text; save the "
            f"profile as UTF-8 CSV"
        ) from None
    try:
        rows = list(_bounded_rows(csv.reader(io.StringIO(text, newline="")), path))
    except csv.Error as err:
        raise ProfileError(f"{path}: not a valid CSV file ({err})") from None
    if not rows or not any(field.strip() for field in rows[0]):
        raise ProfileError(f"{path}: empty; the first row must be the header {','.join(COLUMNS)}")
    return rows


def _bounded_rows(reader: Iterable[list[str]], path: Path) -> Iterable[list[str]]:
    """Rows of a csv reader, refusing overlong fields and too many rows or fields."""
    for row_number, row in enumerate(reader, start=1):
        where = f"{path}, row {row_number}"
        if row_number > MAX_ROWS + 1:
            raise ProfileError(f"{where}: more than {MAX_ROWS:,} measurements; is this a profile?")
        if len(row) > 2 * len(COLUMNS):
            raise ProfileError(f"{where}: {len(row)} fields; a profile row has {len(COLUMNS)}")
        for cell in row:
            if "\n" in cell or "\r" in cell:
                raise ProfileError(f"{where}: a quoted field spans several lines; is a '\"' unclosed?")
            if len(cell) > MAX_FIELD_CHARS:
                raise ProfileError(
                    f"{where}: a field of {len(cell):,} characters ({cell[:20]!r}...); "
                    f"profile fields are short names and numbers"
                )
        yield row


def _check_header(header: list[str], path: Path) -> None:
    expected = f"the header must be {','.join(COLUMNS)}"
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise ProfileError(f"{path}, row 1: column(s) {duplicated} appear more than once; {expected}")
    unknown = [name for name in header if name not in COLUMNS]
    if unknown:
        raise ProfileError(f"{path}, row 1: unknown column(s) {unknown}; {expected}")
    missing = [name for name in COLUMNS if name not in header]
    if missing:
        raise ProfileError(f"{path}, row 1: missing column(s) {missing}; {expected}")


def _parse_instruction(row: Mapping[str, object], where: str) -> str:
    raw = row.get("instruction")
    instruction = str(raw if raw is not None else "").strip()
    if instruction in INSTRUCTIONS:
        return instruction
    names = ", ".join(repr(name) for name in INSTRUCTIONS)
    if not instruction:
        raise ProfileError(f"{where}: field 'instruction' is empty; use one of {names}")
    import difflib  # here: only a mistake needs it (the frontier command's start-up time)

    close = difflib.get_close_matches(instruction.lower(), INSTRUCTIONS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ProfileError(f"{where}: field 'instruction' is {instruction!r}{hint}; use one of {names}")


def _parse_int(
    row: Mapping[str, object], name: str, where: str, minimum: int, maximum: int, meaning: str
) -> int:
    raw = row.get(name)
    text = str(raw).strip()
    if len(text) > MAX_FIELD_CHARS:
        raise ProfileError(f"{where}: field {name!r} is {len(text):,} characters long; it must be {meaning}")
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: field {name!r} is {raw!r}; it must be an integer ({meaning})") from None
    if not minimum <= value <= maximum:
        raise ProfileError(
            f"{where}: field {name!r} is {value}; it must be between {minimum} and {maximum} ({meaning})"
        )
    return value


def _parse_float(row: Mapping[str, object], name: str, where: str, maximum: float, unit: str) -> float:
    raw = row.get(name)
    text = str(raw).strip()
    if len(text) > MAX_FIELD_CHARS:
        raise ProfileError(f"{where}: field {name!r} is {len(text):,} characters long; it must be {unit}")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: field {name!r} is {raw!r}; it must be a number of {unit}") from None
    if not math.isfinite(value) or value <= 0:
        raise ProfileError(
            f"{where}: field {name!r} is {raw!r}; it must be a finite positive number of {unit}"
        )
    if value > maximum:
        hint = " (milliseconds? divide by 1000)" if name == "time" else ""
        raise ProfileError(
            f"{where}: field {name!r} is {value:g} {unit}, more than {maximum:g} for one computation"
            f"{hint}"
        )
    return value
