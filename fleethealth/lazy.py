"""Lazy package exports: a package names what it exports and from which module, and nothing is
imported until first use — so ``import fleethealth.injob`` works on a node without torch and
``import fleethealth.api`` without FastAPI."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` for ``package``, whose ``exports`` map each
    public name to the submodule defining it (a dotted name is a module path from the top, for a
    name the package re-exports from elsewhere). Use: ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module if "." in module else f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
