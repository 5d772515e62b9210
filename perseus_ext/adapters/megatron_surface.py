"""Which functions of megatron-core's schedules module perseus-ext wraps, per release line.

megatron-core's schedule and step functions are plain module functions whose set changes
between releases (0.17 added `backward_step_multimodule`); `PATCH_SURFACES` names them for each
supported release (0.16 to 0.19), `patch_surface` picks the installed one's. This module imports
neither torch nor megatron at import time.
"""

from __future__ import annotations

import dataclasses
import logging

from perseus_ext.errors import ConfigError

log = logging.getLogger("perseus_ext.megatron")

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
NO_PIPELINING = "forward_backward_no_pipelining"
WITHOUT_INTERLEAVING = "forward_backward_pipelining_without_interleaving"
WITH_INTERLEAVING = "forward_backward_pipelining_with_interleaving"


@dataclasses.dataclass(frozen=True)
class PatchSurface:
    """What `install()` replaces in megatron-core's schedules module for one release line."""

    schedules: tuple[str, ...]  # one call = one training iteration (or one evaluation)
    forward_steps: tuple[str, ...]
    backward_steps: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return self.schedules + self.forward_steps + self.backward_steps


_SCHEDULES = (NO_PIPELINING, WITHOUT_INTERLEAVING, WITH_INTERLEAVING)
_SURFACE_0_16 = PatchSurface(_SCHEDULES, ("forward_step",), ("backward_step",))
# 0.17 added backward_step_multimodule (multi-module models; it does not call backward_step).
_SURFACE_0_17 = PatchSurface(_SCHEDULES, ("forward_step",), ("backward_step", "backward_step_multimodule"))
PATCH_SURFACES: dict[tuple[int, int], PatchSurface] = {
    (0, 16): _SURFACE_0_16, (0, 17): _SURFACE_0_17, (0, 18): _SURFACE_0_17, (0, 19): _SURFACE_0_17,
}


def patch_surface(version: str) -> PatchSurface:
    """The surface of a megatron-core version string; ConfigError for releases before 0.16.
    A newer release gets the newest known surface (checked name by name when patching)."""
    major_minor = release_of(version)
    known = sorted(PATCH_SURFACES)
    if major_minor in PATCH_SURFACES:
        return PATCH_SURFACES[major_minor]
    if major_minor < known[0]:
        raise ConfigError(f"perseus: megatron-core {version} is older than the releases perseus-ext "
                          f"hooks (0.16 to 0.19); upgrade megatron-core")
    log.warning("perseus: megatron-core %s is newer than the releases perseus-ext was checked "
                "against (0.16 to 0.19); hooking the 0.19 functions", version)
    return PATCH_SURFACES[known[-1]]


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a megatron-core version string."""
    try:
        return tuple(int(part) for part in version.split(".")[:2])  # type: ignore[return-value]
    except ValueError:
        raise ConfigError(f"perseus: cannot read the megatron-core version {version!r}") from None


def installed_version() -> str:
    """The installed megatron-core's version string."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # a source checkout on the path
        from megatron.core import package_info

        return package_info.__version__
