"""Facts found once about one object — a tokenizer's stop ids and template facts, a model's
packing and decoding-step verdicts — kept on that object (in its ``__dict__``, under
``_lit_rlhf_<name>``): they live and die with the tokenizer or model the run built, and no module of
the package holds state of a run. A deep copy carries them (the copy has the same architecture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_PREFIX = "_lit_rlhf_"


def known(obj: Any, name: str) -> Any | None:
    """The fact ``name`` of ``obj`` if it was found, else None."""
    return vars(obj).get(_PREFIX + name)


def remember(obj: Any, name: str, value: T) -> T:
    """Keep ``value`` as the fact ``name`` of ``obj``; returns it."""
    vars(obj)[_PREFIX + name] = value
    return value


def recall(obj: Any, name: str, find: Callable[[], T]) -> T:
    """The fact ``name`` of ``obj``: ``find()`` the first time, the kept value after."""
    facts = vars(obj)
    key = _PREFIX + name
    if key not in facts:
        facts[key] = find()
    return facts[key]
