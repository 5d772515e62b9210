"""Framework-agnostic Perseus runtime: config, profiling, frontier deployment, straggler policy.

`PerseusConfig` imports without torch or numpy (config checking anywhere); `PerseusRuntime`
loads the planning and device layers on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from perseus_ext.config import PerseusConfig, SimulatedWorkload

if TYPE_CHECKING:
    from perseus_ext.observability.phase import Phase
    from perseus_ext.runtime.runtime import PerseusRuntime

__all__ = ["PerseusConfig", "PerseusRuntime", "Phase", "SimulatedWorkload"]


def __getattr__(name: str) -> Any:
    if name == "PerseusRuntime":
        from perseus_ext.runtime.runtime import PerseusRuntime

        return PerseusRuntime
    if name == "Phase":
        from perseus_ext.observability.phase import Phase

        return Phase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
