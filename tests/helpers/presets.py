"""lit_rlhf.launch.presets.preset for the in-process tests, each preset composed once per test
process (the tests build hundreds of modules from a handful of presets)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from lit_rlhf.launch.presets import composed, merged


@functools.cache
def _composed(name: str) -> dict[str, Any]:
    return composed(name)


def preset(name: str, overrides: Mapping[str, Any] | None = None, **kw: Any) -> dict:
    """``lit_rlhf.launch.presets.preset(name, overrides, **kw)``, from this process's one compose of ``name``."""
    return merged(_composed(name), {**(overrides or {}), **kw})
