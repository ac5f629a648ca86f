"""A callback that records what a training run did, for tests that run train.py's real job
(``+callbacks.snapshot._target_=tests.helpers.snapshot.Snapshot``): the trainable parameters
when fit starts and when it ends, the first training batch, and (SFT stages) the response NLL
on that batch before and after training and the validation perplexity of the starting weights.
With ``out=<file>`` rank 0 also writes the scalars there as JSON (spawned DDP processes)."""

from __future__ import annotations

import json
import math
from typing import Any

import lightning.pytorch as pl
import torch


class Snapshot(pl.Callback):
    runs: list[Snapshot] = []
    """Every instance, in creation order (one per ``run``)."""

    def __init__(self, out: str | None = None) -> None:
        Snapshot.runs.append(self)
        self.out = out
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}
        self.batch: dict[str, torch.Tensor] | None = None
        self.nll_before = self.nll_after = self.val_perplexity_before = None
        self.module: Any = None

    @staticmethod
    def _params(module: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def _mean_nll(self, module: Any) -> float:
        nll, n = module.response_nll(self.batch)
        return float(nll / n)

    @torch.no_grad()
    def _val_perplexity(self, trainer: Any, module: Any) -> float:
        """exp(Σ NLL / Σ response tokens) over this rank's validation batches."""
        nll = tokens = 0.0
        for batch in trainer.datamodule.val_dataloader():
            n, t = module.response_nll(
                {k: v.to(module.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            )
            nll, tokens = nll + float(n), tokens + float(t)
        return math.exp(nll / tokens)

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.before = self._params(module)
        if hasattr(module, "response_nll"):
            self.val_perplexity_before = self._val_perplexity(trainer, module)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if self.batch is None:
            self.batch = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
            if hasattr(module, "response_nll"):
                self.nll_before = self._mean_nll(module)

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.after, self.module = self._params(module), module
        if self.batch is not None and hasattr(module, "response_nll"):
            self.nll_after = self._mean_nll(module)
        if self.out and trainer.is_global_zero:
            with open(self.out, "w") as fh:
                json.dump({k: getattr(self, k) for k in ("nll_before", "nll_after", "val_perplexity_before")}, fh)
