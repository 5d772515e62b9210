"""Bounded reading of the files users hand perseus-ext, with one error wording for all of them.

Why: every file a command or the runtime reads (JSONL logs, frontier JSON, profile side files,
straggler traces, carbon and power-budget CSVs, `--perseus-config`) may be binary, Latin-1,
huge, a directory, deeply nested or hold values no GPU could produce. Each format's reader goes
through these helpers, so that a bad file is refused before it is read whole (size checked
first, a line's length bounded while it is read), and so that every refusal is one `InputError`
line naming the file, the line and the field, and saying what to do -- never a traceback, a hang
or an allocation that grows with the file.

The limits are generous for the files the runtime itself writes and small against a machine's
memory; a reader states its own (`limit_bytes`) and the key or flag that points at the file.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from perseus_ext.errors import PerseusError

MIB = 1 << 20
CONFIG_LIMIT_BYTES = 1 * MIB  # a `perseus` section or --perseus-config file (a real one is < 10 kB)
TABLE_LIMIT_BYTES = 64 * MIB  # CSV traces and tables (a year of 5-minute carbon readings is ~3 MB)
FRONTIER_LIMIT_BYTES = 512 * MIB  # the solver's own frontier JSON (8 x 96: ~40 MB)
LINE_LIMIT_BYTES = 64 * 1024  # one JSONL or CSV line (a log row is ~500 bytes)
CONFIG_DEPTH = 16  # nesting of a config object (the deepest real one is 4)
DATA_DEPTH = 8  # nesting of a data file (a frontier is 4 deep)


class InputError(PerseusError, ValueError):
    """A file a user gave is unreadable, too large or holds a bad value: where and how to fix it."""

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str, *, line: int | None = None,
                 field: str | None = None) -> None:
        self.path, self.line, self.field = str(path), line, field
        where = self.path + (f":{line}" if line is not None else "")
        super().__init__(f"{where}: {field + ': ' if field else ''}{problem}; {fix}")


def _megabytes(size: int) -> str:
    return f"{size / MIB:.1f} MB" if size >= MIB else f"{size} bytes"


def check_file(path: str | os.PathLike[str], *, what: str, limit_bytes: int, fix: str) -> int:
    """The file's size, after refusing a missing file, a directory or one over `limit_bytes`."""
    try:
        status = os.stat(path)
    except OSError as err:
        raise InputError(path, f"cannot read the {what}: {err.strerror or err}", fix) from None
    if os.path.isdir(path):
        raise InputError(path, f"is a directory, not a {what}", fix)
    if status.st_size > limit_bytes:
        raise InputError(path, f"the {what} is {_megabytes(status.st_size)}, more than the {_megabytes(limit_bytes)} "
                               "perseus-ext reads", fix)
    return status.st_size


def _decode(data: bytes, path: str | os.PathLike[str], what: str, fix: str, *, first_line: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise InputError(path, f"the {what} is not UTF-8 text (byte {data[err.start]:#04x}); a binary or "
                               "differently encoded file", fix, line=line) from None


def read_bytes(path: str | os.PathLike[str], *, what: str, limit_bytes: int, fix: str) -> bytes:
    """The whole file, never more than `limit_bytes` read (a file that grows, or one whose size
    the OS does not report, is cut off at the limit and refused)."""
    check_file(path, what=what, limit_bytes=limit_bytes, fix=fix)
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit_bytes + 1)
    except OSError as err:
        raise InputError(path, f"cannot read the {what}: {err.strerror or err}", fix) from None
    if len(data) > limit_bytes:
        raise InputError(path, f"the {what} is more than the {_megabytes(limit_bytes)} perseus-ext reads", fix)
    return data


def read_text(path: str | os.PathLike[str], *, what: str, limit_bytes: int, fix: str) -> str:
    """`read_bytes`, decoded as UTF-8 (an error names the line of the first bad byte)."""
    return _decode(read_bytes(path, what=what, limit_bytes=limit_bytes, fix=fix), path, what, fix)


def iter_lines(path: str | os.PathLike[str], *, what: str, fix: str, start_offset: int = 0,
               first_line: int = 1, line_limit_bytes: int = LINE_LIMIT_BYTES) -> Iterator[tuple[int, int, str]]:
    """(line number, byte offset of the line, text) for every line from `start_offset`, read
    one line at a time: memory is bounded by `line_limit_bytes`, whatever the file's size."""
    check_file(path, what=what, limit_bytes=1 << 62, fix=fix)
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise InputError(path, f"cannot read the {what}: {err.strerror or err}", fix) from None
    with handle:
        handle.seek(start_offset)
        number, offset = first_line, start_offset
        while True:
            try:
                data = handle.readline(line_limit_bytes + 1)
            except OSError as err:
                raise InputError(path, f"cannot read the {what}: {err.strerror or err}", fix, line=number) from None
            if not data:
                return
            if len(data) > line_limit_bytes:
                raise InputError(path, f"the line is longer than {line_limit_bytes} bytes", fix, line=number)
            yield number, offset, _decode(data, path, what, fix, first_line=number)
            number, offset = number + 1, offset + len(data)


def csv_cells(text: str, *, path: str | os.PathLike[str], line: int, fix: str) -> list[str]:
    """One CSV line's cells (a line is shorter than csv's field limit; a carriage return inside
    an unquoted cell is a csv.Error, turned into the line's InputError)."""
    try:
        return next(csv.reader([text]), [])
    except csv.Error as err:
        raise InputError(path, f"not a CSV row ({err})", fix, line=line) from None


def _depth(value: Any) -> int:
    """How deeply `value` nests (iteratively: a deep value must not exhaust Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _Duplicate(Exception):
    pass


def parse_json(text: str | bytes, *, path: str | os.PathLike[str], what: str, fix: str, max_depth: int,
               line: int | None = None, duplicates: bool = False) -> Any:
    """A JSON document: UTF-8, no NaN, no infinity, no number beyond a double, nesting at most
    `max_depth`, and (unless `duplicates`) no object key given twice."""
    if isinstance(text, bytes):
        text = _decode(text, path, what, fix, first_line=line or 1)
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        if "depth limit" in str(err):
            raise InputError(path, f"the {what} nests deeper than {max_depth} levels", fix, line=line) from None
        raise InputError(path, f"the {what} is not valid JSON ({err})", fix, line=line) from None
    if _depth(value) > max_depth:
        raise InputError(path, f"the {what} nests deeper than {max_depth} levels", fix, line=line)
    if not duplicates and "{" in text:
        try:
            json.loads(text, object_pairs_hook=_refuse_duplicates)
        except _Duplicate as dup:
            raise InputError(path, f"key {dup.args[0]!r} is given twice", "keep one of them", line=line,
                             field=str(dup.args[0])) from None
    return value


def require_object(value: Any, *, path: str | os.PathLike[str], what: str, fix: str,
                   field: str | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InputError(path, f"must be a JSON object, got {type(value).__name__}", fix,
                         field=field or f"the {what}")
    return value


def json_number(value: Any, *, path: str | os.PathLike[str], field: str, fix: str, minimum: float | None = 0.0,
                maximum: float | None = None, integer: bool = False) -> float:
    """A JSON value as a finite number within [minimum, maximum] (an int when `integer`)."""
    wanted = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        shown = repr(value)
        raise InputError(path, f"must be {wanted}, got {shown if len(shown) <= 40 else shown[:37] + '...'}", fix,
                         field=field)
    if not math.isfinite(value):
        raise InputError(path, f"{value} is not a finite number", fix, field=field)
    if minimum is not None and value < minimum:
        raise InputError(path, f"{value:g} is below {minimum:g}", fix, field=field)
    if maximum is not None and value > maximum:
        raise InputError(path, f"{value:g} is above {maximum:g}", fix, field=field)
    return value


def validation_problem(err: ValidationError) -> tuple[str, str]:
    """(field, problem) of the first error pydantic found, in the project's wording."""
    first = err.errors(include_url=False)[0]
    field = ".".join(str(part) for part in first["loc"]) or "(record)"
    problem = first["msg"]
    if "input" in first and first["type"] not in ("missing", "json_invalid"):
        shown = repr(first["input"])
        problem += f", got {shown if len(shown) <= 40 else shown[:37] + '...'}"
    return field, problem


def validate_json_line(model: type[BaseModel], text: str, *, path: str | os.PathLike[str], line: int,
                       fix: str) -> Any:
    """One JSONL record as `model` (a pydantic model with strict, finite fields)."""
    try:
        return model.model_validate_json(text)
    except ValidationError as err:
        field, problem = validation_problem(err)
        raise InputError(path, problem, fix, line=line, field=None if field == "(record)" else field) from None


def finite_number(text: str, *, path: str | os.PathLike[str], line: int, field: str, fix: str,
                  minimum: float | None = 0.0, maximum: float | None = None) -> float:
    """A CSV cell as a finite float within [minimum, maximum]."""
    try:
        value = float(text)
    except ValueError:
        raise InputError(path, f"{text.strip()[:40]!r} is not a number", fix, line=line, field=field) from None
    if not math.isfinite(value):
        raise InputError(path, f"{value} is not a finite number", fix, line=line, field=field)
    if minimum is not None and value < minimum:
        raise InputError(path, f"{value:g} is below {minimum:g}", fix, line=line, field=field)
    if maximum is not None and value > maximum:
        raise InputError(path, f"{value:g} is above {maximum:g}", fix, line=line, field=field)
    return value

