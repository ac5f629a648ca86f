"""Shuffled minibatch index sets over a rollout buffer: nothing else."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def iterate_minibatches(
    n: int, size: int, epochs: int, generator: torch.Generator | None = None
) -> Iterator[torch.Tensor]:
    """``epochs`` passes over ``range(n)``, each shuffled and cut into index tensors of ``size``
    (the last one smaller when ``size`` does not divide ``n``)."""
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            yield order[start : start + size]
