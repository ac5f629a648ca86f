"""The one place lit_rlhf touches torch.distributed: in-place sum and min over ranks (no-ops alone)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all processes in place (and return it); a no-op without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_min(x: torch.Tensor) -> torch.Tensor:
    """Minimum of ``x`` over all processes in place (and return it); a no-op without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x
