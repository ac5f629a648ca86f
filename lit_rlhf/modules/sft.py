"""``SFTModule``: supervised fine-tuning of the policy on prompt/response pairs.

Loss = token mean over response tokens (EOS included) of −log π(y_t | x, y_<t); the prompt is
masked out. Validation reports the exact corpus perplexity exp(Σ NLL / Σ tokens), aggregated
over batches and ranks, and — when the data module knows it (the embedded task) — the ratio to
the true language's perplexity on the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import SumMetric

from lit_rlhf.core.logprobs import shifted_token_logprobs
from lit_rlhf.core.masked import masked_sum
from lit_rlhf.modules.base import RLHFModule
from lit_rlhf.modules.configs import SFTConfig


class SFTModule(RLHFModule):
    """Teacher-forced NLL on response tokens. ``data_kind = "sft"`` selects ``data.sft``."""

    config_class = SFTConfig
    data_kind = "sft"
    monitor = ("val/perplexity", "min")  # checkpoint selection (callbacks monitor: auto)

    def __init__(self, config: SFTConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self.model: torch.nn.Module | None = None
        self.val_nll = SumMetric()
        self.val_tokens = SumMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return  # idempotent: Lightning may call it more than once
        from lit_rlhf.models.builders import build_causal_lm

        self.model = self.with_lora(build_causal_lm(self.model_spec, self.ensure_tokenizer()))
        self.model.train()  # from_pretrained returns eval mode (dropout off); Lightning keeps module modes

    def exportable_model(self) -> torch.nn.Module:
        return self.model

    def response_nll(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ NLL over response tokens, number of response tokens) of a batch, both scalars."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = shifted_token_logprobs(logits, batch["input_ids"])  # (B, T)
        mask = batch["response_mask"]  # (B, T) 1 = response token
        return -masked_sum(logprobs, mask), mask.sum()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        nll, n = self.response_nll(batch)
        loss = nll / n.clamp(min=1)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        nll, n = self.response_nll(batch)
        self.val_nll.update(nll)
        self.val_tokens.update(n)

    def on_validation_epoch_end(self) -> None:
        tokens = self.val_tokens.compute()
        if tokens <= 0:
            return
        mean_nll = self.val_nll.compute() / tokens
        self.log("val/loss", mean_nll, sync_dist=False)  # already reduced across ranks
        self.log("val/perplexity", mean_nll.exp(), prog_bar=True)
        floor = getattr(self.trainer.datamodule, "reference_perplexity", None) if self.trainer.datamodule else None
        if floor:
            self.log("val/perplexity_floor", float(floor))
            self.log("val/perplexity_ratio", mean_nll.exp() / floor)
        with torch.inference_mode(False):  # fresh states must be normal tensors: a validation before fit
            self.val_nll.reset()  # runs in inference mode, and the fit's validations update them in place
            self.val_tokens.reset()
