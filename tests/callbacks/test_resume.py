"""ResumeState (lit_rlhf/callbacks/resume.py): the global generators continue after a resume where
the uninterrupted run was, and validation does not consume the training stream."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from lit_rlhf.callbacks.resume import ResumeState


def _trainer(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_rank=0, world_size=1, global_step=step)


def _draw() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def test_restores_every_generator_at_the_first_batch_after_loading():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    saved = ResumeState().state_dict()  # the checkpoint
    expected = _draw()  # what the uninterrupted run draws next
    resumed = ResumeState()
    resumed.load_state_dict(saved)
    _draw()  # a resumed process draws for model init etc. before training
    resumed.on_train_batch_start(_trainer(), None, None, 0)
    assert _draw() == expected
    # only once: later batches are not reset
    resumed.on_train_batch_start(_trainer(), None, None, 1)
    assert _draw() != expected


def test_validation_neither_consumes_nor_depends_on_the_training_stream():
    cb = ResumeState()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    cb.on_validation_start(_trainer(step=4), None)
    val_a = torch.rand(4)
    cb.on_validation_end(_trainer(step=4), None)
    assert torch.equal(torch.get_rng_state(), state)  # training continues as if no validation ran
    torch.manual_seed(99)  # another training stream, same step: the same validation samples
    cb.on_validation_start(_trainer(step=4), None)
    assert torch.equal(torch.rand(4), val_a)
    cb.on_validation_end(_trainer(step=4), None)
    cb.on_validation_start(_trainer(step=5), None)
    assert not torch.equal(torch.rand(4), val_a)  # a later validation samples anew
    cb.on_validation_end(_trainer(step=5), None)
