"""Arguments several subcommands share, checked before any long computation starts.

`frontier` and `emulate` take the same `--profile` (a path or a shipped name) and the same
`--blocking-power` forms (a GPU name or watts); numbers are range-checked by argparse, so a
typo is a one-line usage error (exit 2), never a traceback; output paths are tried for writing
up front, so a solve never ends in an unwritable file.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable

from perseus_ext.errors import ConfigError, ProfileError

# Computations (forward + backward of every microbatch on every virtual stage) the in-process
# solver is asked to plan: 8x the paper's largest pipeline (8 stages x 96 microbatches x 2,
# solved in seconds), so a typo'd size fails at once instead of after minutes and gigabytes.
MAX_COMPUTATIONS = 8 * (8 * 96 * 2)

PROFILE_HELP = "profile CSV (stage,instruction,frequency,time,energy) or a shipped profile name"
BLOCKING_POWER_HELP = (
    "watts one GPU draws while blocked on communication, or a GPU with a published value "
    "(a100 or a40, see perseus_ext.planning.energy.BLOCKING_POWER_W); default: the GPU that a "
    "shipped profile's name names"
)


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is out of range: use {minimum}..{maximum}")
        return value

    parse.__name__ = "integer"
    return parse


def bounded_float(minimum: float, maximum: float, *, inclusive_min: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number in [minimum, maximum] (or (minimum, maximum])."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value >= minimum if inclusive_min else value > minimum
        if not (math.isfinite(value) and above and value <= maximum):
            low = "[" if inclusive_min else "("
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: use a number in {low}{minimum:g}, {maximum:g}]"
            )
        return value

    parse.__name__ = "number"
    return parse


def add_profile_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--profile", required=True, metavar="CSV_OR_NAME", help=PROFILE_HELP)


def add_blocking_power_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--blocking-power", default=None, metavar="WATTS_OR_GPU", help=BLOCKING_POWER_HELP)


def resolve_profile(name: str) -> Path:
    """A profile path, or the name of a shipped profile (e.g. `gpt3-175b-a100_sxm`)."""
    from perseus_ext.data import shipped_profile, shipped_profile_names

    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_profile(name)
    if shipped is not None:
        return shipped
    if path.exists():
        raise ProfileError(f"--profile {name}: not a file")
    raise ProfileError(
        f"--profile {name!r}: no such file, nor a shipped profile "
        f"({', '.join(shipped_profile_names())})"
    )


def blocking_power_w(value: str | None, profile: Path) -> float:
    """--blocking-power as watts; without it, the published value of the GPU that a shipped
    profile's file name names (e.g. `...-a100_sxm.csv` -> a100)."""
    # Not through perseus_ext.emulator: its package imports the policies (and SQLAlchemy), ~0.8 s.
    from perseus_ext.planning.energy import BLOCKING_POWER_W, resolve_blocking_power

    if value is not None:
        try:
            return resolve_blocking_power(value)
        except ConfigError as err:
            raise ConfigError(f"--blocking-power: {err}") from None
    for gpu in BLOCKING_POWER_W:
        if gpu in profile.stem.lower():
            return BLOCKING_POWER_W[gpu]
    raise ConfigError(
        f"--blocking-power is needed: {profile.name} does not name a GPU with a published "
        f"blocking power ({', '.join(BLOCKING_POWER_W)}); pass watts or a GPU name"
    )


def check_pipeline_size(stages: int, microbatches: int, chunks: int, *,
                        flags: tuple[str, str, str] = ("--stages", "--microbatches", "--virtual-stages")) -> None:
    """Refuse a solve too large to plan in one run, naming the flags (stages, microbatches,
    model chunks) that set its size."""
    computations = 2 * stages * microbatches * chunks
    if computations > MAX_COMPUTATIONS:
        stage_flag, microbatch_flag, chunk_flag = flags
        raise ConfigError(
            f"{stage_flag} {stages} x {microbatch_flag} {microbatches} x {chunk_flag} {chunks} is "
            f"{computations:,} computations; the solver plans at most {MAX_COMPUTATIONS:,} in one "
            f"run: lower {microbatch_flag} (at most {max(MAX_COMPUTATIONS // (2 * stages * chunks), 1)} here)"
            f" or {chunk_flag}"
        )


def check_writable_file(path: Path, option: str) -> None:
    """Fail now, not after a long solve, if `path` cannot be written (parents are created,
    as the writers do)."""
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give a file name")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot write there ({err.strerror}); pick a writable path") from None
    if not existed:
        path.unlink()


def check_writable_dir(path: Path, option: str) -> None:
    """Fail now if files cannot be created in directory `path` (created if missing)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".perseus-ext-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot write there ({err.strerror}); pick a writable directory") from None


def check_plotting(path: Path | None, option: str) -> None:
    """A figure needs matplotlib and a supported suffix: check both before solving."""
    import importlib.util

    from perseus_ext.observability.plotting import SUPPORTED_SUFFIXES

    if path is not None and path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise ConfigError(f"{option} {path}: use a file name ending in {', '.join(SUPPORTED_SUFFIXES)}")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"{option} needs matplotlib: pip install 'perseus-ext[plot]'")


class DeprecatedSpelling(argparse.Action):
    """An old spelling of an option: its value goes where the new spelling's goes, and one line
    on stderr names the new spelling (so scripts keep working while they are updated)."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"perseus-ext: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_output_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, help: str,
                        old: tuple[str, ...] = (), metavar: str = "PATH", default: Path | None = None,
                        name: str = "--output") -> None:
    """The one spelling of a command's output path, `--output` (its figure: `--plot`), across
    commands; `old` spellings still work, with a deprecation line."""
    dest = name.lstrip("-").replace("-", "_")
    parser.add_argument(name, type=Path, default=default, metavar=metavar, help=help, dest=dest)
    for spelling in old:
        parser.add_argument(spelling, type=Path, dest=dest, metavar=metavar, action=DeprecatedSpelling,
                            new=name, help=argparse.SUPPRESS)
