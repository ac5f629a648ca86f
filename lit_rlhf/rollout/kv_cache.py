"""The decoding loop's KV cache (lit_rlhf/rollout/generate.py): transformers' ``DynamicCache`` whose
full-attention layers write into buffers allocated once. Imported when a rollout decodes
(transformers is imported lazily by the rest of the package)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer's keys and values in buffers of ``capacity`` positions, allocated at
    the first update (prefill) and written in place at every decoding step."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        b, h, _, _ = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
        self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} positions)")
        self._k[:, :, start:end].copy_(key_states)
        self._v[:, :, start:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def preallocated_cache(model: Any, capacity: int) -> Any:
    """A ``DynamicCache`` whose full-attention layers write into buffers of ``capacity`` positions
    allocated once, instead of growing by ``torch.cat`` (which copies the whole cache at every
    step: quadratic in the response length). Sliding-window and other layer kinds stay as
    transformers builds them."""
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def continuable(cache: Any) -> bool:
    """Whether a multi-turn rollout can keep ``cache`` from one turn to the next
    (:func:`keep_rows`, :func:`reserve`): every layer is a :class:`PreallocatedLayer` that has been filled."""
    return all(type(layer) is PreallocatedLayer and layer.is_initialized for layer in cache.layers)


def keep_rows(cache: Any, rows: Tensor) -> None:
    """Keep only the batch rows ``rows`` of every layer (in that order), in place."""
    for layer in cache.layers:
        layer._k, layer._v = layer._k[rows], layer._v[rows]
        layer.keys, layer.values = layer._k[:, :, : layer.length], layer._v[:, :, : layer.length]


def reserve(cache: Any, capacity: int) -> None:
    """Grow every layer's buffers to hold ``capacity`` positions (the filled ones copied), if smaller."""
    for layer in cache.layers:
        if layer.capacity >= capacity:
            continue
        b, h, _, d = layer._k.shape
        k, v = layer._k.new_empty(b, h, capacity, d), layer._v.new_empty(b, h, capacity, d)
        k[:, :, : layer.length].copy_(layer._k[:, :, : layer.length])
        v[:, :, : layer.length].copy_(layer._v[:, :, : layer.length])
        layer._k, layer._v, layer.capacity = k, v, capacity
        layer.keys, layer.values = k[:, :, : layer.length], v[:, :, : layer.length]
