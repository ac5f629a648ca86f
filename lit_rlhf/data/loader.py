"""A DataLoader that remembers its position, so that a run killed mid-epoch resumes at the next
batch of the same order (docs/architecture.md "Exact resume").

Lightning saves ``state_dict()`` of every training loader that has one in the checkpoint's
``loops.fit_loop.state_dict.combined_loader`` and calls ``load_state_dict`` before the resumed
epoch's first batch; it then expects the loader itself to skip what was consumed (its
batch counter continues from the checkpoint). A plain ``DataLoader`` restarts the epoch from its
first batch instead, which trains twice on some batches and never on others.

The position is ``(epoch, batches yielded)``. It is exact because

* the order is a function of ``(seed, epoch)`` (the samplers of :mod:`lit_rlhf.data.sampler`;
  Lightning calls ``set_epoch`` before each epoch, and under DDP its distributed sampler is
  seeded and epoch-driven too);
* Lightning does not prefetch from loaders whose length it knows, so the batches yielded
  are the batches trained on (worker processes may load ahead; they are not counted);
* a loader never draws from the global torch RNG: without a ``generator`` a DataLoader draws its
  worker base seed from it on every ``iter()``, which would shift the sampling RNG of the run
  (see :class:`lit_rlhf.callbacks.resume.ResumeState`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` plus ``state_dict``/``load_state_dict`` (position in the
    epoch). Skipped batches are read and collated again on resume (cheap for the in-memory,
    pre-tokenised datasets of :mod:`lit_rlhf.data`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(0)  # keep the global RNG untouched
        super().__init__(*args, **kwargs)
        self._epoch: int | None = None
        self._yielded = 0
        self._pending: dict[str, Any] | None = None
        self.lookahead = 0
        """Batches of the epoch shown ahead: each batch (a mapping) also holds ``"ahead"``, the list
        of the next ones (at most this many, fewer at the epoch's end), which are yielded again in
        their turn. Asynchronous rollouts sample them early (lit_rlhf/modules/rl.py). The position
        counts the batches yielded, not those read ahead: a resume yields those again."""

    def _sampler_epoch(self) -> int | None:
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            epoch = getattr(sampler, "epoch", None)
            if epoch is not None:
                return int(epoch)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batches": self._yielded, "length": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)

    def rewind(self) -> None:
        """Count the last batch yielded as not delivered: a checkpoint written now resumes with it
        (an RL iteration that stopped before its update, lit_rlhf/modules/rl.py)."""
        self._yielded = max(0, self._yielded - 1)

    def _resume_skip(self, epoch: int | None) -> int:
        state, self._pending = self._pending, None
        if not state:
            return 0
        done, length = int(state.get("batches", 0)), int(state.get("length", len(self)))
        if state.get("epoch") != epoch or done <= 0:
            return 0  # the checkpoint ended its epoch (or a limit_train_batches cut it): start the next one
        if length != len(self):
            log.warning(
                "the training data changed since the checkpoint (%d batches per epoch, was %d): resuming "
                "after batch %d of the new order, which is not the order the interrupted run would have "
                "seen",
                len(self),
                length,
                min(done, len(self)),
            )
        return done if done < len(self) else 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # a generator: nothing runs before the first batch is asked for, i.e. after set_epoch
        epoch = self._sampler_epoch()
        skip = self._resume_skip(epoch)
        self._epoch, self._yielded = epoch, 0
        it = super().__iter__()
        for _ in range(skip):
            next(it)
            self._yielded += 1
        if skip:
            log.info("resumed mid-epoch: skipped the %d batches of epoch %s trained before the checkpoint", skip, epoch)
        ahead: collections.deque = collections.deque()
        for batch in it:
            ahead.append(batch)
            if len(ahead) > self.lookahead:
                yield self._next(ahead)
        while ahead:
            yield self._next(ahead)

    def _next(self, ahead: collections.deque) -> Any:
        batch = ahead.popleft()
        self._yielded += 1
        return {**batch, "ahead": list(ahead)} if self.lookahead else batch
