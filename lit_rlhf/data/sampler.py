"""Samplers whose order is a pure function of ``(seed, epoch)``, so that a resumed run sees the
same order as an uninterrupted one (docs/architecture.md "Exact resume").

``torch.utils.data.RandomSampler`` draws each epoch's order from a generator whose state moves
on every epoch and is not checkpointed: a run resumed in epoch 3 would replay epoch 0's order.
Here ``set_epoch`` (Lightning calls it before every training epoch, also through its
``DistributedSamplerWrapper`` under DDP) selects the order instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A torch generator for ``(seed, epoch)``: independent streams for neighbouring seeds and
    epochs (``seed + epoch`` would give seed 1/epoch 0 the same order as seed 0/epoch 1)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(epoch)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class EpochSampler(Sampler[int]):
    """A random order of ``range(n)`` per epoch (without replacement), or ``num_samples`` indices
    drawn with replacement; ``set_epoch`` selects the epoch. Same role as ``RandomSampler`` but
    resumable (see the module docstring).

    ``shard=(rank, world_size)``: this rank's share of the epoch's order, every world_size-th
    index from ``rank`` (disjoint across ranks, ``num_samples // world_size`` each), for loaders
    Lightning does not wrap in its distributed sampler (e.g. DAPO's extra prompts).
    """

    def __init__(
        self,
        n: int,
        seed: int = 0,
        replacement: bool = False,
        num_samples: int | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        if n <= 0:
            raise ValueError(f"EpochSampler needs a non-empty dataset, got n={n}")
        if num_samples is not None and not replacement and num_samples > n:
            raise ValueError(f"num_samples={num_samples} > n={n} needs replacement=True")
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"EpochSampler shard: rank {rank} outside world size {world}")
        self.n = n
        self.seed = seed
        self.replacement = replacement
        self.num_samples = n if num_samples is None else num_samples
        self.shard = (rank, world)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.shard[1]

    def __iter__(self) -> Iterator[int]:
        g = epoch_generator(self.seed, self.epoch)
        if self.replacement:
            order = torch.randint(self.n, (self.num_samples,), generator=g)
        else:
            order = torch.randperm(self.n, generator=g)[: self.num_samples]
        rank, world = self.shard
        return iter(order[rank : len(self) * world : world].tolist())


class LengthGroupedSampler(Sampler[int]):
    """A random permutation in which every run of ``batch_size`` consecutive indices has
    similar lengths (sorted inside random mega-chunks of ``batch_size × mega``), batches shuffled,
    the longest batch first so that an out-of-memory shows at step 0.

    Naive equivalent: ``torch.randperm(n)`` (same multiset of indices every epoch), with far
    more padding. Under DDP Lightning wraps it in ``DistributedSamplerWrapper`` (each rank takes
    every world_size-th index, which keeps neighbours similar in length). ``set_epoch`` reshuffles;
    the order is a function of ``(seed, epoch)`` only.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, mega: int = 50) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.mega = mega
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        g = epoch_generator(self.seed, self.epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        chunk = self.batch_size * self.mega
        batches: list[list[int]] = []
        for start in range(0, len(perm), chunk):
            part = sorted(perm[start : start + chunk], key=lambda i: -self.lengths[i])
            batches += [part[i : i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        # a DataLoader cuts this order every batch_size indices: only the last batch may be short
        full = [b for b in batches if len(b) == self.batch_size]
        short = [i for b in batches if len(b) < self.batch_size for i in b]
        full = [full[i] for i in torch.randperm(len(full), generator=g).tolist()]
        if full:
            longest = max(range(len(full)), key=lambda b: max(self.lengths[i] for i in full[b]))
            full[0], full[longest] = full[longest], full[0]
        short_batches = [short[i : i + self.batch_size] for i in range(0, len(short), self.batch_size)]
        return iter([i for b in full + short_batches for i in b])
