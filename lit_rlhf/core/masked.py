"""Masked reductions over (B, T) tensors; masks are 1 = keep (STYLE rule 3)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask over ``dim`` (all elements when None)."""
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask over ``dim``; 0 where the mask is empty (not NaN)."""
    total = masked_sum(x, mask, dim)
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return total / count.clamp(min=1)
