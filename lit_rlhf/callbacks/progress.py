"""``RLProgressBar``: Lightning's TQDM bar, counting RL iterations and optimizer steps in RL stages.

Lightning's bar counts epochs and batches. An RL stage trains for ``trainer.max_steps``
optimizer steps with ``max_epochs=-1``, and one batch (an RL iteration) performs several steps,
so the stock bar shows a meaningless epoch and a batch total that is the step budget. This bar
shows "RL iteration i/N" with N = the iterations the step budget allows, and the optimizer
steps next to it. Stages without rollouts (SFT, RM) get the stock bar. The runner adds it when
``trainer.enable_progress_bar`` is true.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lit_rlhf.callbacks.protocol import rl_stage


def _rl_module(trainer: pl.Trainer) -> Any:
    return rl_stage(trainer.lightning_module)


class RLProgressBar(TQDMProgressBar):
    """TQDM progress bar that speaks in RL iterations for RL stages (:class:`~lit_rlhf.callbacks.protocol.RLStage`)."""

    @property
    def total_train_batches(self) -> int | float:
        module = _rl_module(self.trainer)
        if module is None:
            return super().total_train_batches
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return self.trainer.num_training_batches
        remaining = max(0, max_steps - self.trainer.global_step)
        return min(self.trainer.num_training_batches, math.ceil(remaining / module.updates_per_iteration()))

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        module = _rl_module(trainer)
        if module is not None:
            done = module.rl_iteration
            self.train_progress_bar.initial = 0
            self.train_progress_bar.set_description(f"RL iterations (from {done})" if done else "RL iterations")

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if _rl_module(trainer) is not None:
            metrics.pop("v_num", None)
            budget = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
            metrics["opt_steps"] = f"{trainer.global_step}/{budget}"
        return metrics
