"""Masked reductions over (B, T) tensors; masks are 1 = keep (docs/architecture.md "Conventions").

Cross-rank statistics take an ``all_reduce`` callable that sums a tensor over processes in
place (``lit_rlhf.utils.distributed.all_reduce_sum``); the default is a no-op (one process), so
this module stays free of torch.distributed and Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], Tensor]


def no_all_reduce(x: Tensor) -> Tensor:
    return x


def zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where the mask is 1, exactly 0 elsewhere.

    ``where`` rather than ``x * mask``: a non-finite value at a padded position (inf·0 = NaN)
    must not leak into a result, and its gradient is exactly 0. Losses apply it to their
    per-token inputs before any nonlinear op: masking after ``exp`` would still send
    0·exp(inf) = NaN into ``.grad`` at the padded positions (docs/algorithms.md §2.9).
    """
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x over the masked elements along ``dim`` (all elements when None); padded positions
    never leak in, whatever they hold (:func:`zero_outside`)."""
    masked = zero_outside(x, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask over ``dim``; 0 where the mask is empty (not NaN)."""
    total = masked_sum(x, mask, dim)
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return total / count.clamp(min=1)


def masked_moments(x: Tensor, mask: Tensor, all_reduce: AllReduce = no_all_reduce) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, Bessel-corrected variance and count of the masked elements, across ranks.

    Two all-reduces (count+sum, then the centred sum of squares) instead of Σx² − n·μ², which
    loses precision when the mean is large relative to the spread.
    """
    keep = mask.bool()
    xf = zero_outside(x.float(), keep)  # before the square: no inf/NaN padding in any gradient
    stats = torch.stack([keep.sum().float(), masked_sum(xf, keep)])
    all_reduce(stats)
    count, mean = stats[0], stats[1] / stats[0].clamp(min=1)
    sq = masked_sum((xf - mean) ** 2, keep)
    all_reduce(sq)
    var = sq / (count - 1).clamp(min=1)
    return mean, var, count


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements (Bessel-corrected unless ``unbiased=False``)."""
    x = zero_outside(x, mask)
    mean = masked_mean(x, mask)
    n = mask.to(x.dtype).sum()
    var = masked_mean((x - mean) ** 2, mask)
    return var * n / (n - 1).clamp(min=1) if unbiased else var


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, all_reduce: AllReduce = no_all_reduce, eps: float = 1e-8
) -> Tensor:
    """(x − μ)/σ over the masked elements of all ranks; 0 outside the mask.

    ``shift_mean=False`` rescales without centring (keeps the sign of a one-sided signal).
    """
    mean, var, _ = masked_moments(x, mask, all_reduce)
    out = (zero_outside(x.float(), mask) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device)).to(x.dtype)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) position ids that count real tokens: 0 at each row's first real token, so a
    left-padded row is positioned exactly as it would be alone (pad positions get 0).

    Naive equivalent: per row, ``[max(0, sum(row[: t + 1]) - 1) for t in range(T)]``.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(mask: Tensor) -> Tensor:
    """(B,) position of the last 1 in each row of a (B, T) mask (left or right padded).

    Naive equivalent: ``[max(i for i, m in enumerate(row) if m) for row in mask]``.
    """
    t = mask.shape[-1]
    return t - 1 - mask.flip(-1).long().argmax(-1)


def first_token_index(mask: Tensor) -> Tensor:
    """(B,) position of the first 1 in each row of a (B, T) mask."""
    return mask.long().argmax(-1)
