"""Length-grouped random order: batches of similar lengths, so padding stays small."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class LengthGroupedSampler(Sampler[int]):
    """A random permutation in which every run of ``batch_size`` consecutive indices has
    similar lengths (sorted inside random mega-chunks of ``batch_size × mega``), batches shuffled,
    the longest batch first so that an out-of-memory shows at step 0.

    Naive equivalent: ``torch.randperm(n)`` (same multiset of indices every epoch), with far
    more padding. Under DDP Lightning wraps it in ``DistributedSamplerWrapper`` (each rank takes
    every world_size-th index, which keeps neighbours similar in length). ``set_epoch`` reshuffles.
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
        g = torch.Generator().manual_seed(self.seed + self.epoch)
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
