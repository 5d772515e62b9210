"""The rules of the config models: every mistake becomes one line of a ConfigError.

Why one module: the runtime's `perseus` section and the policies' `perseus.policy` section share
their rules (an integer >= 1, a positive number of watts, unknown keys, a writable path), so each
rule is written once and words its error the same way everywhere. Sections are pydantic v2
models in strict mode (`"5"` is not 5, `true` is not 1). `parse` turns pydantic's
ValidationError into a ConfigError with one line per mistake, each naming the full key
(`perseus.policy.eta`, `perseus.candidate_clocks[1]`), what it must be, what it got and a valid
example. No pydantic message or traceback reaches the user.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import re
import string
import tempfile
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typing_extensions
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from perseus_ext.errors import ConfigError, did_you_mean, unknown_keys_message

VALUE_ERROR = "perseus_value"  # ctx["text"] completes "<key> ..."
KEYS_ERROR = "perseus_keys"  # ctx: unknown and known keys, or missing keys and why they are needed
STATEMENT_ERROR = "perseus_statement"  # ctx["text"] is a whole sentence naming its keys
OWN_ERRORS = frozenset({VALUE_ERROR, KEYS_ERROR, STATEMENT_ERROR})
STRICT = ConfigDict(strict=True, extra="forbid", frozen=True)
_SHOWN_CHARS = 80


def show(value: Any, limit: int | None = _SHOWN_CHARS) -> str:
    """A value as the user wrote it (JSON where possible), cut short (`limit` characters) so
    error lines stay lines; examples are shown whole, so they can be copied."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except (ValueError, RecursionError):  # e.g. an int past Python's digit limit
            text = f"<{type(value).__name__}>"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def value_error(text: str) -> PydanticCustomError:
    """A mistake in one value; `text` completes the sentence that starts with the key."""
    return PydanticCustomError(VALUE_ERROR, "{text}", {"text": text})


def statement_error(text: str, keys: Iterable[str] = ()) -> PydanticCustomError:
    """A mistake across keys: `text` names them in full (e.g. perseus.straggler_hysteresis),
    `keys` lists them, in full, for the ConfigError's `keys` (none: the error's location)."""
    return PydanticCustomError(STATEMENT_ERROR, "{text}", {"text": text, "keys": list(keys)})


class StrChoice(str, enum.Enum):
    """A str-valued enum: members equal, print and serialise as their value (`mode == "observe"`,
    f"{mode}", json.dumps(mode)) on every supported Python (enum.StrEnum needs 3.11)."""

    def __str__(self) -> str:
        return str(self.value)


# --------------------------------------------------------------------------------- rules
def _is_union(schema: Mapping[str, Any]) -> bool:
    while schema.get("type") == "nullable":
        schema = schema["schema"]
    return schema.get("type") in ("union", "tagged-union")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Pydantic metadata: what a value must be, a valid example, and an optional check beyond
    the type. Any failure inside (wrong type, out of range) becomes one error worded from
    `requirement` ("must be an integer >= 1, got 0; e.g. 2"); errors of nested rules (a list's
    element, a section's key) pass through so they keep their precise key."""

    requirement: str
    example: Any = dataclasses.field(compare=False)
    check: Callable[[Any], bool] | None = None
    out_of_range: str | None = None  # wording when the type is right but `check` fails

    def error(self, value: Any, requirement: str | None = None) -> PydanticCustomError:
        return value_error(
            f"must be {requirement or self.requirement}, got {show(value)}; e.g. {show(self.example, None)}"
        )

    def _passes(self, value: Any) -> bool:
        try:
            return bool(self.check(value))
        except (ValueError, TypeError, ArithmeticError):  # e.g. urlparse("http://[") raises
            return False

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        inner = handler(source)
        replace_inner = _is_union(inner)  # union members' errors would name pydantic's tags

        def validate(value: Any, call_inner: Callable[[Any], Any]) -> Any:
            try:
                result = call_inner(value)
            except ValidationError as err:
                if not replace_inner and all(e["type"] in OWN_ERRORS for e in err.errors()):
                    raise
                raise self.error(value) from None
            if self.check is not None and not self._passes(result):
                raise self.error(value, self.out_of_range)
            return result

        return core_schema.no_info_wrap_validator_function(validate, inner)


def rule_of(annotation: Any) -> Rule | None:
    """The outermost Rule of a (possibly Optional) annotation."""
    if typing.get_origin(annotation) is Annotated:
        rules = [m for m in annotation.__metadata__ if isinstance(m, Rule)]
        if rules:
            return rules[-1]
    for argument in typing.get_args(annotation):
        found = rule_of(argument)
        if found is not None:
            return found
    return None


def field_rule(model: type[BaseModel], name: str) -> Rule:
    """The Rule of one field of a section (every field of every section has one)."""
    info = model.model_fields[name]
    rules = [m for m in info.metadata if isinstance(m, Rule)]
    found = rules[-1] if rules else rule_of(info.annotation)
    if found is None:
        raise TypeError(f"{model.__name__}.{name} has no Rule")
    return found


def integer(minimum: int, maximum: int | None = None, *, example: int, what: str = "an integer") -> Any:
    """An int (never a bool) in [minimum, maximum]."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    return Annotated[
        int, Rule(f"{what} {bounds}", example, lambda v: minimum <= v and (maximum is None or v <= maximum))
    ]


def _interval(above: float | None, at_least: float | None, at_most: float | None, below: float | None) -> str:
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else None
    high = f"{below:g})" if below is not None else f"{at_most:g}]" if at_most is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"> {above:g}" if above is not None else f">= {at_least:g}"
    return f"< {below:g}" if below is not None else f"<= {at_most:g}"


def number(
    *,
    example: float,
    unit: str = "",
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    out_of_range: str | None = None,
) -> Any:
    """A finite float (ints accepted, bools not) within the given bounds."""
    of_unit = f" of {unit}" if unit else ""
    if above == 0 and at_least is at_most is below is None:
        requirement = f"a positive number{of_unit}"
    else:
        requirement = f"a number{of_unit} {_interval(above, at_least, at_most, below)}"

    def inside(value: float) -> bool:
        return (
            math.isfinite(value)
            and (above is None or value > above)
            and (at_least is None or value >= at_least)
            and (at_most is None or value <= at_most)
            and (below is None or value < below)
        )

    return Annotated[float, Rule(requirement, example, inside, out_of_range)]


def text(*, example: str, what: str = "a non-empty string") -> Any:
    return Annotated[str, Rule(what, example, lambda s: bool(s.strip()))]


def flag(*, example: bool) -> Any:
    return Annotated[bool, Rule("true or false", example)]


def choice(enum_type: type[enum.Enum], *, example: str) -> Any:
    """One of a str-valued enum's values; the model holds the enum member (equal to its str)."""
    values = {member.value: member for member in enum_type}

    allowed = ", ".join(json.dumps(v) for v in values)

    def from_value(value: Any) -> Any:
        if isinstance(value, str) and value not in values and did_you_mean(value, values):
            raise value_error(f"must be one of {allowed}, got {show(value)}{did_you_mean(value, values)}")
        return values.get(value, value) if isinstance(value, str) else value

    return Annotated[enum_type, BeforeValidator(from_value), Rule(f"one of {allowed}", example)]


def listing(item: Any, *, what: str, example: list, distinct: bool = False) -> Any:
    """A non-empty JSON list (a Python tuple is accepted too), held as a tuple."""

    def check(values: tuple) -> bool:
        return bool(values) and (not distinct or len(set(values)) == len(values))

    requirement = f"a non-empty list of {'distinct ' if distinct else ''}{what}"
    return Annotated[
        tuple[item, ...],
        BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v),
        Rule(requirement, example, check),
    ]


# --------------------------------------------------------------------------------- paths
def unwritable_reason(path: Path) -> str | None:
    """Why a file could not be written at `path` (None: it can, creating missing directories)."""
    if "\0" in str(path):  # pathlib answers False for such paths; open() would raise
        return "is not a usable path (it contains a NUL character)"
    try:
        path = path.absolute()
        if path.is_dir():
            return "is a directory"
        if path.exists():
            if not os.access(path, os.W_OK):
                return "exists and is not writable"
            with open(path, "ab"):  # appends nothing; fails where access() cannot tell (root, /proc)
                return None
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot be created: {parent} is a file, not a directory"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"cannot be created: no permission to write in {parent}"
        # What creating the file's directories will meet: access() says yes to root everywhere,
        # also on read-only mounts and in /proc, so try it with an empty directory, removed at once.
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".perseus-check-", dir=parent))
        except OSError as err:
            return f"cannot be created: nothing can be created in {parent} ({err.strerror or err})"
    except (OSError, ValueError) as err:
        return f"is not a usable path ({err})"
    return None


def require_writable(path_text: str, shown: str | None = None) -> None:
    """A value error (inside validation) unless a file can be written at `path_text`."""
    reason = unwritable_reason(Path(path_text))
    if reason is not None:
        raise value_error(
            f"{shown or show(path_text)} {reason}; use a path in a directory this process can write to"
        )


def _writable_path(path_text: str) -> str:
    require_writable(path_text)
    return path_text


def output_path(*, example: str) -> Any:
    """A file this process will create: its directory must exist or be creatable, writable."""
    return Annotated[
        str, Rule("a non-empty path", example, lambda s: bool(s.strip())), AfterValidator(_writable_path)
    ]


_RANK_SPEC = re.compile(r"0?\d{0,2}d?")  # "{rank}", "{rank:03d}": bounded width, nothing else


def rank_template(*, example: str) -> Any:
    """An output path in which `{rank}` (only) is replaced by the global rank."""

    def bad(what: str, template: str) -> PydanticCustomError:
        return value_error(
            f"{what} (got {show(template)}); only {{rank}} (optionally {{rank:03d}}) is replaced, "
            f"by the global rank; write other braces as {{{{ and }}}}; e.g. {show(example)}"
        )

    def check(template: str) -> str:
        try:
            parts = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)]
        except ValueError:
            raise bad("is not a valid template", template) from None
        unknown = sorted({f"{{{name}}}" for name, _, _ in parts if name not in (None, "rank")})
        if unknown:
            raise bad(f"uses {', '.join(unknown)}", template)
        if any(name == "rank" and (conversion or not _RANK_SPEC.fullmatch(spec)) for name, spec, conversion in parts):
            raise bad("formats {rank} in an unsupported way", template)
        path = template.format(rank=0)
        require_writable(path, f"{show(path)} (rank 0)" if path != template else show(path))
        return template

    return Annotated[str, Rule("a non-empty path", example, lambda s: bool(s.strip())), AfterValidator(check)]


# --------------------------------------------------------------------------------- sections
def section_keys(
    data: Any,
    known: Iterable[str],
    *,
    example: Mapping[str, Any],
    required: Iterable[str] = (),
    why_required: str = "",
) -> dict:
    """`data` as a dict once it is an object whose keys are all known and whose required keys
    are present; otherwise one error naming the keys (and listing the known ones)."""
    if not isinstance(data, Mapping):
        raise value_error(f"must be an object, got {show(data)}; e.g. {show(dict(example), None)}")
    known = set(known)
    unknown = [key for key in data if key not in known]
    if unknown:
        raise PydanticCustomError(
            KEYS_ERROR, "unknown keys", {"unknown": [str(k) for k in unknown], "known": sorted(known)}
        )
    missing = [key for key in required if key not in data]
    if missing:
        raise PydanticCustomError(KEYS_ERROR, "missing keys", {"missing": missing, "why": why_required})
    return dict(data)


class Section(BaseModel):
    """A strict, frozen config section; `example` is a valid value shown in its errors."""

    model_config = STRICT
    example: ClassVar[Mapping[str, Any]] = {}
    why_required: ClassVar[str] = ""  # added to a "missing keys" error: why the section needs them

    @model_validator(mode="before")
    @classmethod
    def _an_object_with_known_keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        required = [name for name, info in cls.model_fields.items() if info.is_required()]
        return section_keys(data, cls.model_fields, example=cls.example, required=required,
                            why_required=cls.why_required)


def keyed(typed_dict: type, *, example: Mapping[str, Any], why_required: str = "") -> Any:
    """A TypedDict sub-section (kept as the dict the user wrote: only the keys given), with the
    same object / unknown-key / required-key errors as a Section."""
    typed_dict.__pydantic_config__ = STRICT  # type: ignore[attr-defined]
    hints = typing_extensions.get_type_hints(typed_dict, include_extras=True)
    # Read from the hints: under `from __future__ import annotations`, __required_keys__ is empty.
    required = sorted(
        key for key, hint in hints.items() if typing_extensions.get_origin(hint) is typing_extensions.Required
    )

    def check(data: Any) -> dict:
        return section_keys(data, hints, example=example, required=required, why_required=why_required)

    return Annotated[typed_dict, BeforeValidator(check)]


def dataclass_section(
    load: Callable[[], type],
    bounds: Callable[[], Mapping[str, Any]],
    *,
    where: str,
    example: Mapping[str, Any],
    errors: tuple[type[Exception], ...],
) -> Any:
    """A plain dataclass (kept free of pydantic) validated at the door: keys are its fields,
    values are checked against `bounds()` (a typed annotation per field), then the dataclass is
    built; an error its constructor raises (from `errors`) names the keys its message mentions.
    `load` and `bounds` run on first use, so a config without this section never pays for
    the dataclass's module."""

    @functools.cache
    def entries_of(cls: type) -> tuple[list[str], TypeAdapter]:
        hints = typing.get_type_hints(cls)
        rules = bounds()
        fields = [f.name for f in dataclasses.fields(cls) if f.init]
        entries = typing_extensions.TypedDict(
            f"{cls.__name__}Section", {n: rules.get(n, hints[n]) for n in fields}, total=False
        )
        return fields, TypeAdapter(keyed(entries, example=example))

    def build(data: Any) -> Any:
        if data is None:
            return None
        cls = load()
        fields, adapter = entries_of(cls)
        if isinstance(data, cls):  # built in Python: its values meet the same bounds
            data = {name: getattr(data, name) for name in fields}
        values = adapter.validate_python(data)
        try:
            return cls(**values)
        except errors as err:
            keys = [f"{where}.{name}" for name in fields if name in str(err)] or [where]
            raise statement_error(f"{', '.join(keys)}: {err}", keys) from None

    return PlainValidator(build)


# --------------------------------------------------------------------------------- parsing
def _line(error: Mapping[str, Any], root: str) -> str:
    path = root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == VALUE_ERROR:
        return f"{path} {ctx['text']}"
    if kind == STATEMENT_ERROR:
        return ctx["text"]
    if kind == KEYS_ERROR and "unknown" in ctx:
        return unknown_keys_message(path, ctx["unknown"], ctx["known"])
    if kind == KEYS_ERROR:
        return "; ".join(f"{path}.{key} is required{ctx['why']}" for key in ctx["missing"])
    return f"{path}: {error['msg']}"  # every field has a Rule, so this is a safety net


def describe(error: ValidationError, root: str) -> str:
    """One line per mistake (duplicates dropped), under a count when there are several."""
    lines = list(dict.fromkeys(_line(e, root) for e in error.errors(include_url=False)))
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} mistakes in {root}:\n" + "\n".join(f"- {line}" for line in lines)


def _keys(error: Mapping[str, Any], root: str) -> list[str]:
    """The full keys one pydantic error is about: its location's names (list positions
    dropped), the unknown or missing keys it names, or the keys a cross-key statement lists in
    `ctx["keys"]`; none for a statement about the whole section that lists none."""
    ctx = error.get("ctx") or {}
    path = ".".join([root, *(str(part) for part in error["loc"] if not isinstance(part, int))])
    if error["type"] == KEYS_ERROR:
        return [f"{path}.{key}" for key in (*ctx.get("unknown", ()), *ctx.get("missing", ()))]
    if error["type"] == STATEMENT_ERROR and ctx.get("keys"):
        return [str(key) for key in ctx["keys"]]
    return [path] if error["loc"] else []


def parse(model: type[BaseModel], data: Any, *, root: str) -> Any:
    """`model` validated from `data`, or a ConfigError describing every mistake and carrying
    the keys they are about (`ConfigError.keys`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = err.errors(include_url=False)
        raise ConfigError(describe(err, root), keys=[key for problem in problems for key in _keys(problem, root)]) from None
