"""Start-up hook run by `perseus_ext_autoload.pth` in every Python process of the environment.

It must cost next to nothing, so it imports only modules the interpreter has already loaded
(`os`, `sys`) and adds one import hook. The hook does nothing until some code imports
`deepspeed`; then, right after DeepSpeed's own import, it

- hooks `deepspeed.initialize` (`perseus_ext.adapters.deepspeed.install`), so a `"perseus"`
  section in the DeepSpeed config is all a job needs; or, with PERSEUS_AUTOLOAD=0,
- only makes `deepspeed.initialize` warn when the config enables `"perseus"` but nothing
  attached perseus-ext (DeepSpeed itself ignores unknown config keys without a word).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # `typing` is not loaded at start-up; importing it would cost time
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any, Callable

AUTOLOAD_ENV = "PERSEUS_AUTOLOAD"  # "0": do not attach on import, only warn about a lost section


def autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "1").strip() != "0"


def at_startup() -> None:
    """Entry point of the `.pth` line: reads PERSEUS_AUTOLOAD, then adds the import hook."""
    on_import = _install if autoload_enabled() else _warn_only
    if "deepspeed" in sys.modules:
        _run_safely(on_import, sys.modules["deepspeed"])
    elif not any(isinstance(finder, DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook(on_import))


def _install(deepspeed_module: ModuleType) -> None:
    from perseus_ext.adapters.deepspeed import install

    install(deepspeed_module)


def _warn_only(deepspeed_module: ModuleType) -> None:
    from perseus_ext.adapters.deepspeed import warn_if_unattached

    warn_if_unattached(deepspeed_module)


def _run_safely(on_import: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        on_import(module)
    except Exception as err:  # a broken hook must never break `import deepspeed`
        print(f"perseus-ext: could not hook deepspeed.initialize: {err!r}", file=sys.stderr)


class DeepSpeedImportHook:
    """A `sys.meta_path` finder that runs `on_import(deepspeed)` once DeepSpeed is imported.

    It answers only for `deepspeed`, then removes itself, finds the real package with the
    remaining finders and wraps that loader's `exec_module`.
    """

    def __init__(self, on_import: Callable[[ModuleType], None]) -> None:
        self.on_import = on_import

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deepspeed":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_hook(module: ModuleType) -> None:
            exec_module(module)
            _run_safely(self.on_import, module)

        spec.loader.exec_module = exec_and_hook  # type: ignore[method-assign]
        return spec
