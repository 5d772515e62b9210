"""Files shipped inside the package, so a wheel install has them too.

- `profiles/`: the published per-stage profiles of the Perseus SOSP'24 artifact (see its
  README); the CLI accepts their names (`gpt3-175b-a100_sxm`) wherever it takes a profile.
- `patches/`: the Megatron-LM patches adding `--perseus` to `pretrain_gpt.py` (in the source
  tree a link to the top-level `patches/`; `perseus-ext patch-path` prints where they are).

Resources are found next to this module, inside the installed package (pip installs wheels
unzipped), never relative to the source checkout; `importlib.resources` would find the same
directory and cost every command ~5 ms of imports.
"""

from __future__ import annotations

from pathlib import Path

PROFILE_SUFFIX = ".csv"


def _directory(name: str) -> Path:
    """A shipped data directory as a filesystem path (pip installs wheels unzipped)."""
    return Path(__file__).parent / name


def shipped_profile_names() -> list[str]:
    """Names of the shipped profiles (file names without `.csv`), sorted."""
    return sorted(p.stem for p in _directory("profiles").glob(f"*{PROFILE_SUFFIX}"))


def shipped_profile(name: str) -> Path | None:
    """The shipped profile called `name` (with or without `.csv`), or None if there is none."""
    stem = name[: -len(PROFILE_SUFFIX)] if name.endswith(PROFILE_SUFFIX) else name
    if stem not in shipped_profile_names():
        return None
    return _directory("profiles") / f"{stem}{PROFILE_SUFFIX}"


def patches_dir() -> Path:
    """The directory of the shipped Megatron-LM patches."""
    return _directory("patches")
