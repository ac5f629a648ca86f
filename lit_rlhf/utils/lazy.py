"""A package's names imported on first use, so that importing the package stays light (a module's
``__getattr__``, PEP 562): ``__getattr__ = lazy_names(__name__, {"Name": "submodule"})``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``where[name]`` is the submodule that defines ``name``."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
