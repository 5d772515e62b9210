"""Megatron `--perseus*` flags, generated from `PerseusConfig` so they can never drift from it.

`--perseus` turns the runtime on (the `enabled` key), `--perseus-config FILE` reads the same
JSON section as the DeepSpeed `"perseus"` key, and every other key has one `--perseus-<key>`
flag (`_` becomes `-`) whose help is the key's description. Flags parse loosely on purpose:
booleans take true/false words, lists take several values, object-valued keys take JSON, and
whatever does not parse stays text — so a bad value never makes argparse exit the trainer; it
reaches `PerseusConfig.from_dict`, and `config_from_args` raises one ConfigError naming the key
and its flag. The parser `add_perseus_args` extends validates the section as soon as Megatron
parses its arguments (before it builds anything), and `config_from_args` hands that same typed
config on afterwards instead of parsing again. This module imports neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
import weakref
from collections.abc import Callable
from typing import Any

from perseus_ext.errors import ConfigError, PerseusError

ENABLE_FLAG = "--perseus"
CONFIG_FLAG = "--perseus-config"
_MENTIONED_KEY = re.compile(r"\bperseus\.(\w+)")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")

# The typed config parsed with each namespace, by id (a weak reference tells a reused id apart).
# Not an attribute of the namespace: Megatron-LM saves its args in every checkpoint, and a
# checkpoint must load where perseus-ext is not installed.
_PARSED: dict[int, tuple[weakref.ref, Any]] = {}


def flag_name(key: str) -> str:
    """The Megatron flag of a top-level `perseus` key."""
    return ENABLE_FLAG if key == "enabled" else f"--perseus-{key.replace('_', '-')}"


def _dest(key: str) -> str:
    return f"perseus_{key}"


def _flag_keys() -> dict[str, Any]:
    """The `PerseusConfig` fields that get a `--perseus-<key>` flag (all but `enabled`)."""
    from perseus_ext.runtime.config import PerseusConfig

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
    from perseus_ext.runtime.config import PerseusConfig
    from perseus_ext.schema import field_rule

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


def _parse_at_the_door(parser: argparse.ArgumentParser) -> None:
    """Make `parser` validate the perseus section right after it parses (Megatron's
    `parse_args` calls `parse_known_args` either way): a bad flag fails before Megatron builds
    anything, and `config_from_args` returns this typed config later."""
    original = parser.parse_known_args
    if getattr(original, "_perseus_door", False):
        return

    def parse_known_args(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = original(args, namespace)
        _PARSED.pop(id(parsed), None)
        config = config_from_args(parsed)
        _PARSED[id(parsed)] = (weakref.ref(parsed), config)
        return parsed, extras

    parse_known_args._perseus_door = True  # type: ignore[attr-defined]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


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
    except ConfigError:
        raise
    except PerseusError as err:
        raise ConfigError(f"{CONFIG_FLAG} {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FLAG}: {path!r} must hold a JSON object")
    if isinstance(data.get("perseus"), dict):
        data = data["perseus"]  # a whole DeepSpeed config
    return data


def config_from_args(args: argparse.Namespace):
    """The `PerseusConfig` the flags describe (validated completely), or None when `--perseus`
    is off. A bad value raises ConfigError naming the key and its flag."""
    from perseus_ext.runtime.config import PerseusConfig

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
    try:
        return PerseusConfig.from_dict(section)
    except ConfigError as exc:
        keys = dict.fromkeys(_MENTIONED_KEY.findall(str(exc)))
        flags = [flag_name(key) for key in keys if key in PerseusConfig.model_fields]
        separator = "\n" if "\n" in str(exc) else " "
        hint = (f"{separator}(Megatron flag {', '.join(flags)} or {CONFIG_FLAG})" if flags
                else f"{separator}(in {CONFIG_FLAG} {args.perseus_config})" if getattr(args, "perseus_config", None)
                else "")
        raise ConfigError(f"{exc}{hint}") from None


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
    options = policy.batch_size_settings
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
