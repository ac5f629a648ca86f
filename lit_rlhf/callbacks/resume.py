"""What a checkpoint needs beyond Lightning's own state for an exact resume (docs/architecture.md
"Exact resume"): random number generator states, and the data loaders' positions delivered.

Loader positions: Lightning saves the ``state_dict`` of every resumable training loader
(:class:`lit_rlhf.data.loader.ResumableDataLoader`) but only hands it back if its training
dataloader was first built after the checkpoint was restored. Our modules size their LR
schedules with ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, which builds
the loader earlier; Lightning (2.6) then never loads the saved positions and the resumed epoch
restarts from its first batch. :class:`ResumeState` reads them from the checkpoint itself and
gives them to the loaders in ``on_train_start``, before the first batch is fetched.

RNG: sampling responses, dropout and anything else drawing from the global generators (torch CPU and
CUDA, numpy, Python's ``random``) continue after a resume exactly where the uninterrupted run
would have been: :class:`ResumeState` saves every rank's generator states with each checkpoint and
puts them back just before the first training batch after the resume (not at load time:
whatever runs between loading and that batch must not shift them).

Validation is made neutral to the training stream: it runs on generators seeded from
``(seed, global_step)`` and the training states are restored afterwards. Otherwise a validation
that samples (RL and DPO validation do) would consume draws the training batches after it depend
on, and a resumed run, which does not repeat the validation before the checkpoint, would differ.
A side effect users see: validation samples are reproducible, the same in a resumed run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from lit_rlhf.callbacks.csv_log import RunCSVLogger
from lit_rlhf.utils.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, state)  # every rank saves (Lightning calls state_dict on all ranks)
    return out


class ResumeState(Callback):
    """Checkpoints the global RNG states of all ranks and restores them at the first batch after a
    resume; delivers the saved loader positions; keeps validation off the training RNG stream.
    The runner adds it to every training job."""

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] | None = None
        self._outside_validation: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "ResumeState"

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        fit_state = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {}
        self._loader_states = fit_state.get("combined_loader") or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers:  # the run's CSV log keeps a resumed run's earlier rows
            if isinstance(logger, RunCSVLogger):
                logger.fit_started(resumed=trainer.ckpt_path is not None)
        states, self._loader_states = self._loader_states, None
        from lit_rlhf.utils.compat.lightning import combined_loader

        combined = combined_loader(trainer)
        if not states or combined is None:
            return
        loaders = [dl for dl in combined.flattened if callable(getattr(dl, "load_state_dict", None))]
        if len(loaders) != len(states):
            raise RuntimeError(
                f"the checkpoint holds the positions of {len(states)} training loaders, this run has "
                f"{len(loaders)}: resume with the data configuration the checkpoint was made with"
            )
        for loader, state in zip(loaders, states):
            loader.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": _gather(capture_rng())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = list(state_dict.get("ranks") or []) or None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is None:
            return
        ranks, self._pending = self._pending, None
        if len(ranks) != trainer.world_size:
            log.warning(
                "the checkpoint holds the RNG states of %d processes, this run has %d: the sampling after "
                "the resume is not the interrupted run's",
                len(ranks),
                trainer.world_size,
            )
        restore_rng(ranks[trainer.global_rank % len(ranks)])

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outside_validation = capture_rng()
        base = int(os.environ.get("PL_GLOBAL_SEED", 0))
        seed = np.random.SeedSequence([base & 0xFFFFFFFF, trainer.global_step, trainer.global_rank]).generate_state(1)[
            0
        ]
        torch.manual_seed(int(seed))  # CPU and every CUDA device

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._outside_validation is not None:
            restore_rng(self._outside_validation)
            self._outside_validation = None
