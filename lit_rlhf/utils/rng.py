"""The process's global random generators (torch CPU and the current CUDA device, NumPy, Python's
``random``) captured and put back: exact resume (lit_rlhf/callbacks/resume.py) and code that must not
shift them (the vLLM engine's start-up, which seeds them all: lit_rlhf/rollout/vllm_engine.py)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The state of every global generator of this process, in types a ``weights_only`` load
    accepts (tensors, tuples, numbers: no numpy arrays)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one per process
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Whatever runs inside leaves the global generators as they were before it."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)
