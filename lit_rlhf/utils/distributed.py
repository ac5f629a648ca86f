"""The one place lit_rlhf touches torch.distributed: in-place sum, min and max over ranks (no-ops alone)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """``x`` reduced over all processes in place by ``dist.ReduceOp.<op>``; a no-op without a
    process group (nor any use of torch.distributed where it is not built)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return x


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all processes in place (and return it); a no-op without a process group."""
    return _all_reduce(x, "SUM")


def all_reduce_min(x: torch.Tensor) -> torch.Tensor:
    """Minimum of ``x`` over all processes in place (and return it); a no-op without a process group."""
    return _all_reduce(x, "MIN")


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum of ``x`` over all processes in place (and return it); a no-op without a process group."""
    return _all_reduce(x, "MAX")
