"""Megatron `--perseus*` flags, generated from `PerseusConfig` so they can never drift from it.

`--perseus` turns the runtime on (the `enabled` key), `--perseus-config FILE` reads the same
JSON section as the DeepSpeed `"perseus"` key, and every other key has one `--perseus-<key>`
flag (`_` becomes `-`) whose help is the key's description. Flags read their text loosely
(booleans take true/false words, lists take several values, object-valued keys take JSON, and
whatever does not parse stays text) so that every value reaches `PerseusConfig`, whose rules
word the mistake. The parser `add_perseus_args` extends then validates the section as soon as
Megatron parses its arguments (before it builds anything): a bad value or config file ends the
parse as argparse ends it for any bad flag, with the usage and one `error:` line naming the flag
(found from the keys the ConfigError carries, not from its wording), exit status 2. Abbreviated
or unknown `--perseus*` flags are refused the same way. `config_from_args` hands the typed config
on afterwards instead of parsing again. This module imports neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from perseus_ext.errors import ConfigError, PerseusError, did_you_mean

ENABLE_FLAG = "--perseus"
CONFIG_FLAG = "--perseus-config"
PREFIX = "perseus"
NO_PIPELINE_FIX = ("use --perseus-mode observe, a power-limit policy "
                   "(--perseus-policy '{\"type\": \"zeus\", \"mode\": \"power_limit\"}') or "
                   "--pipeline-model-parallel-size > 1")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")

# The typed config parsed with each namespace, by id (a weak reference tells a reused id apart).
# Not an attribute of the namespace: Megatron-LM saves its args in every checkpoint, and a
# checkpoint must load where perseus-ext is not installed.
_PARSED: dict[int, tuple[weakref.ref, Any]] = {}


class FlagError(ConfigError):
    """A `--perseus*` flag, or the `--perseus-config` file, is bad. `flags` names the flags to
    blame and `reason` says what is wrong; the message adds where (for callers of
    `config_from_args`), and `usage_line` is argparse's wording for the parser's `error:` line."""

    def __init__(self, reason: str, *, flags: Iterable[str], keys: Iterable[str] = (), message: str | None = None):
        super().__init__(reason if message is None else message, keys=keys)
        self.reason = reason
        self.flags = tuple(flags)

    def usage_line(self) -> str:
        """`argument --perseus-x: <reason>`, as argparse words a bad value (one line)."""
        noun = "argument" if len(self.flags) == 1 else "arguments"
        return f"{noun} {', '.join(self.flags)}: {_one_line(self.reason)}"

    def __reduce__(self) -> tuple:
        return _rebuild_flag_error, (self.reason, self.flags, self.keys, str(self))


def _rebuild_flag_error(reason: str, flags: tuple[str, ...], keys: tuple[str, ...], message: str) -> FlagError:
    return FlagError(reason, flags=flags, keys=keys, message=message)


def flag_name(key: str) -> str:
    """The Megatron flag of a top-level `perseus` key."""
    return ENABLE_FLAG if key == "enabled" else f"--perseus-{key.replace('_', '-')}"


def _dest(key: str) -> str:
    return f"perseus_{key}"


def _flag_keys() -> dict[str, Any]:
    """The `PerseusConfig` fields that get a `--perseus-<key>` flag (all but `enabled`)."""
    from perseus_ext.config import PerseusConfig

    return {name: info for name, info in PerseusConfig.model_fields.items() if name != "enabled"}


def _leaf_types(annotation: Any) -> list[Any]:
    """The types a field's value may have, without Annotated metadata and None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _leaf_types(arg)]
    return [] if annotation is type(None) else [annotation]


def value_kind(annotation: Any) -> str:
    """How a flag reads its value: "bool" (a true/false word), "list" (several values) or
    "json" (one JSON value, else the text itself)."""
    leaves = _leaf_types(annotation)
    if leaves and all(leaf is bool for leaf in leaves):
        return "bool"
    if any(typing.get_origin(leaf) in (list, tuple) for leaf in leaves):
        return "list"
    return "json"


def _json_or_text(text: str) -> Any:
    """Numbers, null, lists and objects as JSON; anything else (e.g. `min`) as the text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _bool_or_text(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in _TRUE_WORDS:
        return True
    if lowered in _FALSE_WORDS:
        return False
    if lowered == "null":  # e.g. dry_run: null = decide from the process's privileges
        return None
    return text  # PerseusConfig names the key: "must be true or false"


_READERS: dict[str, tuple[Callable[[str], Any], str | None, str]] = {
    "bool": (_bool_or_text, None, "{true,false}"),
    "list": (_json_or_text, "+", "VALUE"),
    "json": (_json_or_text, None, "VALUE"),
}


def add_perseus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `perseus` argument group; returns the parser (Megatron-LM's
    `extra_args_provider` contract).

    `--perseus` turns the runtime on; `--perseus-config FILE` reads the same JSON section as the
    DeepSpeed `"perseus"` key (a whole DeepSpeed config with a `"perseus"` key also works);
    every key also has its own `--perseus-<key>` flag, which overrides the file.
    """
    group = parser.add_argument_group("perseus", "energy-bloat removal for pipeline parallelism (perseus-ext)")
    group.add_argument(
        ENABLE_FLAG, action="store_true",
        help="profile the pipeline, plan per-computation GPU clocks and deploy them",
    )
    group.add_argument(
        CONFIG_FLAG, metavar="FILE",
        help="JSON file with the perseus section (same keys as the DeepSpeed 'perseus' key)",
    )
    from perseus_ext.config import PerseusConfig
    from perseus_ext.config.rules import field_rule

    for key, info in _flag_keys().items():
        reader, nargs, metavar = _READERS[value_kind(info.annotation)]
        default = json.dumps(info.get_default(call_default_factory=True))
        requirement = field_rule(PerseusConfig, key).requirement
        group.add_argument(
            flag_name(key),
            dest=_dest(key),
            type=reader,
            nargs=nargs,
            default=argparse.SUPPRESS,  # absent unless given, so `null` can override the file
            metavar=metavar,
            help=f"config key '{key}' ({requirement}; default {default}): {info.description}".replace("%", "%%"),
        )
    _parse_at_the_door(parser)
    return parser


def _unknown_perseus_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--perseus*` options on the command line that are not exactly one of the parser's: an
    abbreviation (argparse would expand it on a parser with `allow_abbrev=True`; Megatron-LM's
    parser refuses it) or a misspelling (`parse_known_args`, which Megatron-LM uses with
    `--ignore-unknown-args`-style callers, would hand it back silently)."""
    unknown = []
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if name.startswith(ENABLE_FLAG) and name not in parser._option_string_actions:
            unknown.append(name)
    return unknown


def _one_line(text: str) -> str:
    """A several-mistake message (a header line, then one `- ` line per mistake) as one line, so
    argparse's single `error:` line holds it."""
    header, *items = text.splitlines() or [""]
    return " ".join([header, "; ".join(item.removeprefix("- ") for item in items)]).strip()


def _parse_at_the_door(parser: argparse.ArgumentParser) -> None:
    """Make `parser` validate the perseus section right after it parses (Megatron's
    `parse_args` calls `parse_known_args` either way): a bad flag or config file fails as
    argparse fails for any bad flag — the usage, one `error:` line naming the flag, exit status
    2 — before Megatron builds anything, and `config_from_args` returns this typed config later.
    A parser made with `exit_on_error=False` gets the `FlagError` raised instead, as argparse
    raises its own errors then."""
    original = parser.parse_known_args
    if getattr(original, "_perseus_door", False):
        return

    def refuse(err: FlagError) -> typing.NoReturn:
        if parser.exit_on_error:
            parser.error(err.usage_line())
        raise err

    def parse_known_args(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        argv = sys.argv[1:] if args is None else [str(arg) for arg in args]
        for name in _unknown_perseus_flags(parser, argv):
            known = sorted(flag for flag in parser._option_string_actions if flag.startswith(ENABLE_FLAG))
            completions = [flag for flag in known if flag.startswith(name)]
            refuse(FlagError(f"perseus flags are never abbreviated; write {' or '.join(completions)} in full"
                             if completions else f"unrecognized perseus flag{did_you_mean(name, known)}",
                             flags=(name,)))
        parsed, extras = original(args, namespace)
        _PARSED.pop(id(parsed), None)
        try:
            config = config_from_args(parsed)
            _check_pipeline(parsed, config)
            _check_layout(parsed, config)
        except FlagError as err:
            refuse(err)
        _PARSED[id(parsed)] = (weakref.ref(parsed), config)
        return parsed, extras

    parse_known_args._perseus_door = True  # type: ignore[attr-defined]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


PIPELINE_FLAG = "--pipeline-model-parallel-size"


def _check_pipeline(args: argparse.Namespace, config: Any) -> None:
    """`optimize` needs pipeline stages: when the parser also knows Megatron's
    `--pipeline-model-parallel-size` (Megatron-LM's does), a value of 1 fails with the flags."""
    from perseus_ext.adapters.common import check_mode

    stages = getattr(args, "pipeline_model_parallel_size", None)
    if config is None or not isinstance(stages, int):
        return
    try:
        check_mode(config, has_pipeline=stages > 1, without_pipeline=f"{PIPELINE_FLAG} is {stages}",
                   fix=NO_PIPELINE_FIX)
    except ConfigError as err:
        given = [flag_name("mode")] if hasattr(args, _dest("mode")) else [ENABLE_FLAG]
        raise FlagError(str(err), flags=(*given, PIPELINE_FLAG), keys=(f"{PREFIX}.mode",)) from None


def _check_layout(args: argparse.Namespace, config: Any) -> None:
    """A `--pipeline-model-parallel-layout` whose chunks perseus-ext cannot plan fails with the
    flags (`megatron_layout`), as a bad value of Megatron's own would."""
    from perseus_ext.adapters.megatron_layout import LAYOUT_FLAG, check_layout

    try:
        check_layout(args, config)
    except ConfigError as err:
        given = [flag_name("mode")] if hasattr(args, _dest("mode")) else [ENABLE_FLAG]
        raise FlagError(str(err).removeprefix("perseus: "), flags=(*given, LAYOUT_FLAG),
                        keys=(f"{PREFIX}.mode",)) from None


def chain_extra_args(
    *providers: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Combine several Megatron-LM `extra_args_provider`s (None entries are skipped)."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in providers:
            if provider is not None:
                parser = provider(parser)
        return parser

    return provide


def _read_config_file(path: str) -> dict:
    """The `--perseus-config` file: at most 1 MB of UTF-8 JSON, nested at most 16 deep, no key
    twice (perseus_ext.inputs), holding a `perseus` section or a whole DeepSpeed config."""
    from perseus_ext.inputs import CONFIG_DEPTH, CONFIG_LIMIT_BYTES, parse_json, read_text

    what, fix = "perseus config file", f"give {CONFIG_FLAG} the JSON of a \"perseus\" section (or a DeepSpeed config)"
    try:
        data = parse_json(read_text(path, what=what, limit_bytes=CONFIG_LIMIT_BYTES, fix=fix), path=path, what=what,
                          fix=fix, max_depth=CONFIG_DEPTH)
    except PerseusError as err:
        raise FlagError(str(err), flags=(CONFIG_FLAG,), message=f"{CONFIG_FLAG} {err}") from None
    if not isinstance(data, dict):
        raise FlagError(f"{path!r} must hold a JSON object", flags=(CONFIG_FLAG,),
                        message=f"{CONFIG_FLAG}: {path!r} must hold a JSON object")
    if isinstance(data.get("perseus"), dict):
        data = data["perseus"]  # a whole DeepSpeed config
    return data


def _blamed_flags(keys: tuple[str, ...], args: argparse.Namespace) -> list[str]:
    """The flags behind a mistake about `keys` (full keys, `ConfigError.keys`): each key's own
    flag when it was given (it overrides the file), else `--perseus-config` when a file was
    given; when the keys came from neither (their defaults), their own flags, the way to fix
    them. A mistake about no key blames every perseus flag given."""
    from perseus_ext.config import PerseusConfig

    from_file = bool(getattr(args, "perseus_config", None))
    given, defaults = [], []
    for key in keys:
        top = key.removeprefix(f"{PREFIX}.").split(".")[0]
        if top in PerseusConfig.model_fields and (top == "enabled" or hasattr(args, _dest(top))):
            given.append(flag_name(top))
        elif from_file:
            given.append(CONFIG_FLAG)
        elif top in PerseusConfig.model_fields:
            defaults.append(flag_name(top))
    flags = given or defaults
    if not flags:
        flags = [flag_name(key) for key in _flag_keys() if hasattr(args, _dest(key))]
        flags += [CONFIG_FLAG] if from_file else []
    return list(dict.fromkeys(flags)) or [ENABLE_FLAG]


def config_from_args(args: argparse.Namespace):
    """The `PerseusConfig` the flags describe (validated completely), or None when `--perseus`
    is off. A bad value raises FlagError (a ConfigError) naming the key and the flag it came
    from."""
    from perseus_ext.config import PerseusConfig

    reference, parsed = _PARSED.get(id(args), (None, None))
    if reference is not None and reference() is args:
        return parsed  # validated when the arguments were parsed
    if not getattr(args, "perseus", False):
        return None
    section: dict = {}
    if getattr(args, "perseus_config", None):
        section.update(_read_config_file(args.perseus_config))
    for key in _flag_keys():
        if hasattr(args, _dest(key)):
            section[key] = getattr(args, _dest(key))
    section["enabled"] = True
    from perseus_ext.adapters.common import RankCounts, check_rank_values

    try:
        config = PerseusConfig.from_dict(section)
        check_rank_values(config, RankCounts.from_env())  # every rank's port and paths, before any trains
        return config
    except ConfigError as exc:
        flags = _blamed_flags(exc.keys, args)
        shown = [f"{flag} {args.perseus_config}" if flag == CONFIG_FLAG else flag for flag in flags]
        separator = "\n" if "\n" in str(exc) else " "
        raise FlagError(str(exc), flags=flags, keys=exc.keys,
                        message=f"{exc}{separator}(Megatron flag {', '.join(shown)})") from None


GLOBAL_BATCH_FLAG = "--global-batch-size"


def _data_parallel_size(args: argparse.Namespace) -> int:
    """Megatron's data-parallel size: from its parallel state once initialised, else the world
    size over the model-parallel sizes in `args`."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_world_size()
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= getattr(args, name, None) or 1
    return max(world // model_parallel, 1)


def apply_run_batch_size(args: argparse.Namespace, config: Any) -> Any:
    """Under `--perseus` with `policy.batch_size`: set `args.global_batch_size` to this run's
    batch size from the store (rank 0 asks, every rank gets the same) and reconfigure
    megatron-core's microbatch calculator if it already exists. Call before the number of
    microbatches is derived; returns the `PreparedRun` to hand to the runtime (None without a
    batch-size policy).

    A flag that contradicts the store's choice fails with its name: a `--global-batch-size`
    other than `default_batch_size` (or the micro batch x DP that Megatron fills in without
    the flag), `--rampup-batch-size`, or a `--micro-batch-size` x DP that does not divide every
    candidate."""
    import logging
    import os

    policy = getattr(config, "policy", None)
    if config is None or policy is None or policy.batch_size is None:
        return None
    options = policy.batch_size
    where = "perseus.policy.batch_size"
    sizes, default = sorted(options.batch_sizes), options.default_batch_size
    if getattr(args, "rampup_batch_size", None):
        raise ConfigError(f"--rampup-batch-size conflicts with {where}: the store picks one global batch size per "
                          f"run; drop --rampup-batch-size or the batch_size section")
    micro = getattr(args, "micro_batch_size", None) or 1
    data_parallel = _data_parallel_size(args)
    given = getattr(args, "global_batch_size", None)
    if given is not None and given not in (default, micro * data_parallel):
        raise ConfigError(f"{GLOBAL_BATCH_FLAG} {given} conflicts with {where}: the store picks the global batch "
                          f"size from {sizes} under --perseus; drop {GLOBAL_BATCH_FLAG} or set it to "
                          f"default_batch_size {default}")
    per_step = micro * data_parallel
    bad = [size for size in sizes if size % per_step]
    if bad:
        raise ConfigError(f"{where}.batch_sizes {bad} are not multiples of --micro-batch-size {micro} x data-parallel "
                          f"size {data_parallel} = {per_step}; list multiples of {per_step} or change "
                          f"--micro-batch-size")
    from perseus_ext.runtime.recurring import choose_batch_size

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    prepared = choose_batch_size(config, num_gpus=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    assignment = prepared.assignment
    args.global_batch_size = assignment.batch_size
    from megatron.core import num_microbatches_calculator as calculator

    if calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        calculator.reconfigure_num_microbatches_calculator(
            int(os.environ.get("RANK", "0")), None, assignment.batch_size, micro, data_parallel)
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("perseus_ext.megatron").info(
            "perseus: run %d of job %r trains with %s %d (%s): %d microbatches of %d x data-parallel %d",
            assignment.run_id, assignment.job_id, GLOBAL_BATCH_FLAG, assignment.batch_size, assignment.phase,
            assignment.batch_size // per_step, micro, data_parallel)
    return prepared
