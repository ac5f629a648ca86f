"""``RewardModelModule``: a pairwise (Bradley–Terry) reward model (docs/algorithms.md §1).

loss = mean[−logsigmoid(r_w − r_l − margin)] + β_rm · NLL(y_w | x) + c · mean[(r_w + r_l)²]

Chosen and rejected sequences go through the backbone in ONE forward (stacked batch). Metrics
aggregate with torchmetrics across batches and ranks: ``val/accuracy``, ``val/margin``,
``val/score_mean``, ``val/score_std`` (and ``test/…`` with a 95% Wilson interval). Training logs
``rm/accuracy``, ``rm/margin``, ``rm/score_mean``, ``rm/score_std`` over every window of
``trainer.log_every_n_steps`` batches, with the same torchmetrics (so over all ranks and all the
window's batches, not the last batch), and the loss terms ``rm/bt_loss``, ``rm/center_loss``,
``rm/lm_loss`` per step.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import CatMetric, MeanMetric, SumMetric

from lit_rlhf.core.logprobs import shifted_token_logprobs
from lit_rlhf.core.losses import pairwise_rm_loss
from lit_rlhf.core.masked import masked_mean
from lit_rlhf.modules.base import RLHFModule
from lit_rlhf.modules.configs import RMConfig
from lit_rlhf.utils.config import ConfigError

log = logging.getLogger(__name__)


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (better than ±1.96·se at small n)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


class PreferenceMetrics(nn.Module):
    """Accuracy, mean margin, score mean/std and score lists over a whole evaluation epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.correct = SumMetric()
        self.pairs = SumMetric()
        self.margin = MeanMetric()
        self.score_sum = SumMetric()
        self.score_sq = SumMetric()
        self.chosen = CatMetric()
        self.rejected = CatMetric()

    def update(self, chosen: Tensor, rejected: Tensor) -> None:
        chosen, rejected = chosen.detach().float(), rejected.detach().float()
        both = torch.cat([chosen, rejected])
        self.correct.update((chosen > rejected).float().sum())
        self.pairs.update(torch.tensor(float(chosen.numel()), device=chosen.device))
        self.margin.update(chosen - rejected)
        self.score_sum.update(both.sum())
        self.score_sq.update((both**2).sum())
        self.chosen.update(chosen)
        self.rejected.update(rejected)

    def compute(self) -> dict[str, Any]:
        n = self.pairs.compute()
        mean = self.score_sum.compute() / (2 * n)
        var = (self.score_sq.compute() / (2 * n) - mean**2).clamp(min=0)
        return {
            "accuracy": self.correct.compute() / n,
            "margin": self.margin.compute(),
            "score_mean": mean,
            "score_std": var.sqrt(),
            "pairs": n,
            "correct": self.correct.compute(),
            "chosen_scores": self.chosen.compute(),
            "rejected_scores": self.rejected.compute(),
        }

    def reset(self) -> None:
        with torch.inference_mode(False):  # fresh states must be normal tensors (validation runs in inference mode)
            for m in self.children():
                m.reset()


class RewardModelModule(RLHFModule):
    """Trains a scalar reward head (+ backbone) on preference pairs; ``data_kind = "preference"``."""

    config_class = RMConfig
    data_kind = "preference"
    monitor = ("val/accuracy", "max")

    def __init__(self, config: RMConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self.reward_model: nn.Module | None = None
        self.train_metrics = PreferenceMetrics()
        self.val_metrics = PreferenceMetrics()
        self.test_metrics = PreferenceMetrics()

    @classmethod
    def planned_models(cls, config: RMConfig) -> list[tuple[str, str, str | None]]:
        return [("reward model", "trained", None)]

    @classmethod
    def check_compatible(cls, config: RMConfig, model_spec: Any) -> None:
        """Cross-group checks, run by the runner before anything is built."""
        if config.beta_rm > 0 and model_spec.kind != "causal_lm":
            raise ConfigError("algo.beta_rm", f"the LM term needs a causal LM backbone; model.kind={model_spec.kind}")

    def configure_model(self) -> None:
        if self.reward_model is not None:
            return
        from lit_rlhf.models.reward import build_reward_model

        self.check_compatible(self.config, self.model_spec)
        self.reward_model = build_reward_model(
            self.model_spec, self.ensure_tokenizer(), self.config.pooling, self.config.head_init_std
        )
        self.with_lora(self.reward_model.backbone)  # the head trains in full
        self.reward_model.padding_free = self.config.padding_free
        self.reward_model.train()  # from_pretrained returns eval mode; Lightning keeps module modes
        if self.reward_model.kind == "causal_lm" and self.config.beta_rm == 0:
            from lit_rlhf.models.builders import freeze_untied_lm_head

            freeze_untied_lm_head(self.reward_model.backbone)  # unused without the LM term

    def exportable_model(self) -> nn.Module:
        return self.reward_model

    # ------------------------------------------------------------------ steps
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T) → (B,) scores."""
        return self.reward_model(input_ids, attention_mask)

    def _scores(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen scores (B,), rejected scores (B,), hidden (2B, T, H))."""
        hidden = self.reward_model.hidden_states(batch["input_ids"], batch["attention_mask"])
        scores = self.reward_model.score_hidden(hidden, batch["attention_mask"])
        b = scores.shape[0] // 2
        return scores[:b], scores[b:], hidden

    def lm_loss(self, batch: dict[str, Tensor], hidden: Tensor) -> Tensor:
        """Token-mean NLL of the chosen responses (rows [0, B) of the stacked batch)."""
        b = hidden.shape[0] // 2
        ids = batch["input_ids"][:b]
        logits = self.reward_model.lm_logits(hidden[:b])
        return -masked_mean(shifted_token_logprobs(logits, ids), batch["response_mask"][:b])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        chosen, rejected, hidden = self._scores(batch)
        loss, stats = pairwise_rm_loss(chosen, rejected, batch.get("margin"), self.config.center_coef)
        if self.config.beta_rm > 0:
            lm = self.lm_loss(batch, hidden)
            loss = loss + self.config.beta_rm * lm
            stats["lm_loss"] = lm.detach()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log_stats("rm", {k: v for k, v in stats.items() if k.endswith("_loss")})
        self.train_metrics.update(chosen, rejected)
        window = max(1, int(getattr(self.trainer, "log_every_n_steps", 1) or 1))
        if (batch_idx + 1) % window == 0 or self.trainer.is_last_batch:
            self._log_window("rm", self.train_metrics)
        return loss

    def _log_window(self, prefix: str, metrics: PreferenceMetrics) -> None:
        """The aggregate of the batches since the last call (all ranks: compute() syncs), then reset."""
        out = metrics.compute()
        self.log_dict({f"{prefix}/{k}": out[k] for k in ("accuracy", "margin", "score_mean", "score_std")})
        metrics.reset()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        chosen, rejected, _ = self._scores(batch)
        self.val_metrics.update(chosen, rejected)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        chosen, rejected, _ = self._scores(batch)
        self.test_metrics.update(chosen, rejected)

    def _log_epoch(self, prefix: str, metrics: PreferenceMetrics) -> None:
        if metrics.pairs.update_count == 0:
            return
        out = metrics.compute()
        for key in ("accuracy", "margin", "score_mean", "score_std"):
            self.log(f"{prefix}/{key}", out[key], prog_bar=key == "accuracy")
        if prefix == "test":
            n = int(out["pairs"].item())
            low, high = wilson_interval(out["correct"].item(), n)
            self.log_dict({"test/accuracy_ci_low": low, "test/accuracy_ci_high": high, "test/pairs": float(n)})
        gold = getattr(self.trainer.datamodule, "gold_accuracy", {}) if self.trainer.datamodule else {}
        if gold.get(prefix):
            self.log(f"{prefix}/gold_accuracy", gold[prefix])
        self._log_histograms(prefix, out["chosen_scores"], out["rejected_scores"])
        metrics.reset()

    def _log_histograms(self, prefix: str, chosen: Tensor, rejected: Tensor) -> None:
        """Score histograms on loggers that have them (W&B, TensorBoard); CSV has none."""
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        from lit_rlhf.utils.loggers import log_histogram

        log_histogram(self.loggers, f"{prefix}/score_chosen_hist", chosen, self.global_step)
        log_histogram(self.loggers, f"{prefix}/score_rejected_hist", rejected, self.global_step)

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_metrics)

    def on_fit_end(self) -> None:
        if not self.config.export_dir:
            return
        best = self._best_checkpoint()
        if self._trainer is not None:
            best = self.trainer.strategy.broadcast(best)  # every rank takes the same branch in export
        state = None
        if best:
            ok, state = True, {}  # only rank zero's state is written
            if self._trainer is None or self.trainer.is_global_zero:
                try:
                    state = self.best_state_dict(best)
                    log.info("exporting the best checkpoint by %s: %s", self.monitor[0], best)
                except (KeyError, OSError, RuntimeError, ValueError) as e:
                    log.warning("cannot read the best checkpoint %s (%s): exporting the last weights", best, e)
                    ok = False
            if self._trainer is not None:
                ok = self.trainer.strategy.broadcast(ok)
            if not ok:
                state = None  # the live weights (gathered collectively where sharded)
        self.export(self.config.export_dir, state_dict=state)

    def best_state_dict(self, path: str) -> dict[str, Tensor]:
        """The LightningModule state of checkpoint ``path`` (a file, or a DeepSpeed ZeRO folder whose
        shards are merged into fp32 weights), cast to the live parameters' dtypes. Raises if it does
        not hold every weight of the reward model (a partial export would load as garbage)."""
        if os.path.isdir(path):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            merged = get_fp32_state_dict_from_zero_checkpoint(path)
            state = {k.removeprefix("_forward_module."): v for k, v in merged.items()}
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        live = {f"reward_model.{k}": v for k, v in self.reward_model.state_dict().items()}
        missing = sorted(set(live) - set(state))
        if missing:
            raise KeyError(f"best checkpoint {path} lacks {len(missing)} reward-model weights, e.g. {missing[:3]}")
        return {k: state[k].to(v.dtype) for k, v in live.items()}

    def _best_checkpoint(self) -> str | None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        if not self.config.export_best:
            return None
        for cb in self.trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor == self.monitor[0] and cb.best_model_path:
                return cb.best_model_path
        return None
