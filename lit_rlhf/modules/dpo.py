"""``DPOModule``: direct preference optimization — DPO, cDPO, IPO (docs/algorithms.md §5).

One training step = one batch of preference pairs from the reward model's data module (the
same formats, truncation and bad-row rules): the policy scores chosen and rejected in ONE
concatenated forward (rows [0, B) chosen, [B, 2B) rejected), the reference either live (a frozen
model, never checkpointed, reloaded from its path) or precomputed once over the dataset before
training (``precompute_ref_logprobs``; no reference in memory while training), and
:func:`~lit_rlhf.core.losses.dpo_loss` turns the four sequence log-probs into the loss.

DPO has no rollouts, so its drift is invisible to the loss curves. Every validation therefore
also samples responses to ``drift_prompts`` held-out prompts through the one rollout path and
returns them as ``{"rollout": …}``: the stability monitors (callbacks=rlhf) log
``stability/kl`` to the reference, ``stability/perplexity``, ``stability/response_length`` and
the truncation rate on the same dashboard as PPO's.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from torch import Tensor, nn
from lit_rlhf.core.losses import dpo_loss
from lit_rlhf.models.packed import sequence_logprobs
from lit_rlhf.modules.base import RLHFModule, policy_spec
from lit_rlhf.modules.configs import DPOConfig
from lit_rlhf.utils.config import ConfigError

log = logging.getLogger(__name__)
# metric key -> logged name (docs/metrics.md; TRL's names, so dashboards carry over)
NAMES = {"loss": "loss", "rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
         "accuracies": "rewards/accuracies", "margins": "rewards/margins", "logps_chosen": "logps/chosen",
         "logps_rejected": "logps/rejected"}  # fmt: skip


class DPOMetrics(nn.Module):
    """Pair-weighted means over a window of batches and all ranks.

    One (8,) vector of sums per window (one in-place add per step; one all-reduce when the
    window is read) instead of a metric object per quantity: the step is the hot path of DPO.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("sums", torch.zeros(len(NAMES) + 1, dtype=torch.float64), persistent=False)

    @torch.no_grad()
    def update(self, loss: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor, chosen: Tensor, rejected: Tensor):
        n = float(chosen.shape[0])
        values = torch.stack([loss.detach().float() * n, chosen_rewards.sum(), rejected_rewards.sum(),
                              (chosen_rewards > rejected_rewards).float().sum(), (chosen_rewards - rejected_rewards).sum(),
                              chosen.detach().sum(), rejected.detach().sum(), chosen.new_tensor(n)])  # fmt: skip
        self.sums += values.to(self.sums)  # order: NAMES, then the pair count

    def compute_and_reset(self) -> dict[str, Tensor] | None:
        from lit_rlhf.utils.distributed import all_reduce_sum

        totals = all_reduce_sum(self.sums.clone())
        with torch.inference_mode(False):  # stays a normal tensor (validation runs in inference mode)
            self.sums = torch.zeros_like(self.sums, device=self.sums.device)
        if totals[-1] <= 0:
            return None
        return {k: (totals[i] / totals[-1]).float() for i, k in enumerate(NAMES)}


def _names(prefix: str, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """{"rewards_chosen": …} → {"<prefix>rewards/chosen": …}."""
    return {prefix + NAMES[k]: v for k, v in values.items()}


class DPOModule(RLHFModule):
    """Trains ``self.policy`` on preference pairs against a frozen reference. ``data_kind = "preference"``."""

    config_class = DPOConfig
    data_kind = "preference"
    monitor = ("val/loss", "min")
    model_path_keys = ("policy_path", "reference_path")

    def __init__(self, config: DPOConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self.policy: nn.Module | None = None
        self.frozen: dict[str, nn.Module] = {}  # the reference: not a submodule, never checkpointed
        self.ref_table: dict[str, Tensor] = {}  # split -> (N, 2) precomputed reference log-probs
        self.train_metrics, self.val_metrics, self.test_metrics = DPOMetrics(), DPOMetrics(), DPOMetrics()
        self._drift_seen = 0  # drift prompts sampled in the current validation (per process)

    # ------------------------------------------------------------ runner hooks
    @classmethod
    def resolve_model_spec(cls, config: DPOConfig, spec: Any) -> Any:
        return policy_spec(config.policy_path, spec)

    @classmethod
    def planned_models(cls, config: DPOConfig) -> list[tuple[str, str, str | None]]:
        out = [("policy", "trained", config.policy_path)]
        if not config.precompute_ref_logprobs:  # the cached log-probs replace the reference in training
            out.append(("reference", "frozen-ref", config.reference_path or config.policy_path))
        return out

    @classmethod
    def check_compatible(cls, config: DPOConfig, spec: Any) -> None:
        if spec.kind != "causal_lm":
            raise ConfigError("model.kind", f"DPO trains a causal LM policy; model.kind={spec.kind}")

    # ------------------------------------------------------------------ models
    def reference_spec(self) -> Any:
        path = self.config.reference_path
        return self.model_spec if path is None else self.model_spec.at_path(path)

    def build_reference(self) -> Any:
        """π_ref: ``reference_path``'s model, else the starting policy — under LoRA the policy with
        its adapters disabled (no copy)."""
        from lit_rlhf.models.builders import build_causal_lm, freeze

        def build() -> nn.Module:
            return freeze(build_causal_lm(self.reference_spec(), self.ensure_tokenizer())).to(self.device)

        if self.config.reference_path is not None or self.policy is None:
            return build()
        return self.reference_for(self.policy, build)

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from lit_rlhf.models.builders import build_causal_lm

        self.policy = self.with_lora(build_causal_lm(self.model_spec, self.ensure_tokenizer())).train()
        if not self.config.precompute_ref_logprobs:
            self.frozen["reference"] = self.build_reference()

    def exportable_model(self) -> nn.Module:
        return self.policy

    def on_fit_start(self) -> None:
        if self.config.precompute_ref_logprobs:
            self.ref_table = self.precompute_reference()
        for m in self.frozen.values():
            m.to(self.device)

    # --------------------------------------------------------------- log-probs
    def sequence_logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(B,) chosen and (B,) rejected log-probs of the response tokens, in ONE forward of the
        2B stacked sequences: packed without padding (``padding_free``), or right-padded."""
        logps = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                  self.config.padding_free)  # fmt: skip
        b = logps.shape[0] // 2
        return logps[:b], logps[b:]

    def reference_logps(self, batch: dict[str, Any], split: str) -> tuple[Tensor, Tensor]:
        if self.config.precompute_ref_logprobs:
            table = self.ref_table[split][batch["pair_index"].cpu()].to(self.device)
            return table[:, 0], table[:, 1]
        with torch.no_grad():  # (not inference mode: the rows are sliced from a batch that enters autograd)
            return self.sequence_logps(self.frozen["reference"], batch)

    def precompute_reference(self) -> dict[str, Tensor]:
        """Reference log-probs of every pair of every split, computed once (or read from the cache
        when its fingerprint matches), then the reference model is released."""
        dm = self.trainer.datamodule
        fingerprint = self._fingerprint(dm)
        path = self.config.ref_cache or os.path.join(self.trainer.default_root_dir or ".", "ref_logprobs.pt")
        if os.path.isfile(path):
            cached = torch.load(path, map_location="cpu", weights_only=True)
            if cached.get("fingerprint") == fingerprint:
                log.info("reference log-probs: reusing %s", path)
                return cached["tables"]
            log.info("reference log-probs: %s was computed for other pairs or another reference; recomputing", path)
        reference, tables = self.build_reference(), {}
        with torch.no_grad():
            for split, pairs in dm.splits.items():
                table = torch.zeros(len(pairs), 2)
                loader = dm.ordered_dataloader(split)
                for batch in loader if len(pairs) else []:
                    batch = self.trainer.strategy.batch_to_device(batch)
                    chosen, rejected = self.sequence_logps(reference, batch)
                    table[batch["pair_index"].cpu()] = torch.stack([chosen, rejected], 1).float().cpu()
                tables[split] = table
        del reference
        if self.trainer.is_global_zero:
            from lit_rlhf.utils.io import atomic_torch_save

            atomic_torch_save({"fingerprint": fingerprint, "tables": tables}, path)
            log.info("reference log-probs of %s pairs cached in %s", {k: len(v) for k, v in tables.items()}, path)
        self.trainer.strategy.barrier("dpo_ref_cache")
        return tables

    def _fingerprint(self, dm: Any) -> str:
        h = hashlib.sha256(repr(self.reference_spec()).encode())
        for split in sorted(dm.splits):
            for e in dm.splits[split]:
                h.update(repr((split, e.chosen.prompt_ids, e.chosen.response_ids, e.rejected.response_ids)).encode())
        return h.hexdigest()

    # ------------------------------------------------------------------- steps
    def pair_loss(self, batch: dict[str, Any], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        c: DPOConfig = self.config
        chosen, rejected = self.sequence_logps(self.policy, batch)
        ref_chosen, ref_rejected = self.reference_logps(batch, split)
        loss, stats = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, c.beta, c.loss_type, c.label_smoothing)
        metrics = {"train": self.train_metrics, "val": self.val_metrics, "test": self.test_metrics}[split]
        metrics.update(loss, stats["chosen_rewards"], stats["rejected_rewards"], chosen, rejected)
        return loss, stats

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, _ = self.pair_loss(batch, "train")
        window = max(1, int(self.trainer.log_every_n_steps or 1))
        if (batch_idx + 1) % window == 0 or self.trainer.is_last_batch:
            values = self.train_metrics.compute_and_reset()
            if values is not None:  # the window's aggregate over all ranks
                names = _names("", {k: v for k, v in values.items() if k != "loss"})
                self.log_dict({**names, "train/loss": values["loss"],
                               "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"]}, sync_dist=False)  # fmt: skip
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        self.pair_loss(batch, "val")
        return self.drift_rollout(batch, batch_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.pair_loss(batch, "test")

    def on_test_epoch_end(self) -> None:
        """Held-out implicit-reward accuracy with its 95% Wilson interval (as the reward model's)."""
        from lit_rlhf.modules.reward_model import wilson_interval
        from lit_rlhf.utils.distributed import all_reduce_sum

        pairs = float(all_reduce_sum(self.test_metrics.sums[-1:].clone()))
        values = self.test_metrics.compute_and_reset()
        if values is None:
            return
        low, high = wilson_interval(float(values["accuracies"]) * pairs, int(pairs))
        self.log_dict({**_names("test/", values), "test/accuracy_ci_low": low, "test/accuracy_ci_high": high,
                       "test/pairs": pairs}, sync_dist=False)  # fmt: skip

    def on_validation_epoch_start(self) -> None:
        self._drift_seen = 0
        if self.config.drift_prompts and self.config.precompute_ref_logprobs:
            self.frozen["reference"] = self.build_reference()  # for the drift's KL only; released at epoch end

    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.compute_and_reset()
        if values is not None:
            self.log_dict(_names("val/", values), sync_dist=False)  # already reduced across ranks
        if self.config.precompute_ref_logprobs:
            self.frozen.pop("reference", None)

    # ------------------------------------------------------------------ drift

    def drift_rollout(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        """Sample the policy on this batch's prompts while fewer than ``drift_prompts`` were sampled
        this validation; the rollout (with the reference's log-probs) goes to the monitors."""
        left = self.config.drift_prompts - self._drift_seen
        if left <= 0 or self.trainer.sanity_checking:
            return None
        from lit_rlhf.data.collate import prompts_of_pairs
        from lit_rlhf.rollout.collect import generate_and_score

        prompts = prompts_of_pairs(batch, self.tokenizer.pad_token_id, limit=left)
        self._drift_seen += len(prompts["prompts"])
        with self.sampling_mode(self.policy):
            rollout = generate_and_score(self.policy, prompts, self.tokenizer, self.config.generation,
                                         reference=self.frozen.get("reference"),
                                         padding_free=self.config.padding_free)  # fmt: skip
        return {"rollout": rollout.normal_tensors()}
