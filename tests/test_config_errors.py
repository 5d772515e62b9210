"""One error hierarchy: every exception class perseus-ext defines is a PerseusError (so one
`except PerseusError` catches all it raises on purpose) and is listed in errors.py's
docstring, with the module it lives in. Found by reading the source (any module, imported or
not), checked on the classes themselves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import perseus_ext.errors
from perseus_ext.errors import PerseusError

PACKAGE = Path(perseus_ext.errors.__file__).resolve().parent


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every public class whose bases name an error or an exception."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = [ast.unparse(base) for base in node.bases]
            if any(base.endswith(("Error", "Exception")) or base == "PerseusError" for base in bases):
                found.append((module, node.name))
    return found


def test_every_error_is_a_perseus_error_listed_in_errors_py():
    classes = _exception_classes()
    assert len(classes) >= 20  # the walk found the package's errors (GPU, config, input, ...)
    listing = perseus_ext.errors.__doc__
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, PerseusError), f"{module}.{name} is outside the PerseusError hierarchy"
        assert name in listing, f"{module}.{name} is missing from errors.py's list"
        if module != "perseus_ext.errors":
            where = module.removeprefix("perseus_ext.").replace(".", "/") + ".py"
            assert where in listing, f"errors.py's list does not say {name} lives in {where}"
