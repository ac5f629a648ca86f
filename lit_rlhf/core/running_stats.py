"""Running mean/std of a stream of values across batches and ranks (reward scaling, docs/algorithms.md §2)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], Tensor]


class RunningMoments:
    """Mean and Bessel-corrected std of every value seen, merged batch by batch.

    Chan et al.'s parallel update: for the running (n, μ, M2) and a batch (n_b, μ_b, M2_b),
    δ = μ_b − μ;  n' = n + n_b;  μ' = μ + δ·n_b/n';  M2' = M2 + M2_b + δ²·n·n_b/n'.
    Batch statistics are summed over ranks with ``all_reduce`` (in-place sum; None = one rank),
    so every rank holds the same moments.
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: Tensor, all_reduce: AllReduce | None = None) -> tuple[float, float]:
        """Merge a batch; returns the batch's (mean, std) over all ranks."""
        x = values.detach().float().flatten()
        stats = torch.stack([x.new_tensor(float(x.numel())), x.sum()])
        if all_reduce is not None:
            all_reduce(stats)
        n_b = stats[0].item()
        if n_b == 0:
            return 0.0, 0.0
        mean_b = stats[1].item() / n_b
        sq = ((x - mean_b) ** 2).sum()
        if all_reduce is not None:
            all_reduce(sq)
        m2_b = sq.item()
        delta = mean_b - self.mean
        total = self.count + n_b
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * self.count * n_b / total
        self.count = total
        return mean_b, math.sqrt(m2_b / (n_b - 1)) if n_b > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
