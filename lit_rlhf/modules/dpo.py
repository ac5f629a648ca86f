"""``DPOModule``: direct preference optimization — DPO, cDPO, IPO (docs/algorithms.md §5), and
the reference-free SimPO (§5.1) and ORPO (§5.2) and the unpaired KTO (§5.3), each an
``algo.loss_type`` of this one module (presets ``algo=simpo|orpo|kto``).

One training step = one batch of preference pairs from the reward model's data module (the
same formats, truncation and bad-row rules): the policy scores chosen and rejected in ONE
concatenated forward (rows [0, B) chosen, [B, 2B) rejected), the reference either live (a frozen
model, never checkpointed, reloaded from its path) or precomputed once over the dataset before
training (``precompute_ref_logprobs``; no reference in memory while training), and the
``algo.loss_type`` entry of the pair-loss table (lit_rlhf/core/objectives.py ``PAIR_LOSSES``) says
which function turns the sequence log-probs into the loss and what it reads: SimPO and ORPO build
no reference at all and read the policy's average per-token log-probs.
KTO's batches are unpaired examples (``data.preference.unpaired``): rows [0, B) the completions,
[B, 2B) their KL rows (each prompt with another example's completion), which give the reference
point z_ref (:func:`~lit_rlhf.core.losses.kto_reference_point`, averaged over all ranks).

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

from lit_rlhf.core.losses import kto_reference_point
from lit_rlhf.models.packed import sequence_logprobs
from lit_rlhf.modules.base import RLHFModule, policy_spec
from lit_rlhf.modules.configs import DPOConfig
from lit_rlhf.utils.config import ConfigError

log = logging.getLogger(__name__)
# metric key -> logged name (docs/metrics.md; TRL's names, so dashboards carry over). KTO's
# chosen/rejected are its desirable/undesirable examples (as TRL's KTO logs them).
NAMES = {
    "loss": "loss",
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "accuracies": "rewards/accuracies",
    "margins": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
    "kl": "kl",
}
SUMMED = [k for k in NAMES if k != "margins"]  # margins = rewards/chosen − rewards/rejected, derived when read


class DPOMetrics(nn.Module):
    """Means over a window of batches and all ranks, each quantity over its own count (pairs;
    KTO's desirable or undesirable examples; steps for KTO's z_ref).

    One (2, K) tensor of sums and counts per window (one in-place add per step; one all-reduce
    when the window is read) instead of a metric object per quantity: the step is the hot path.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("sums", torch.zeros(2, len(SUMMED), dtype=torch.float64), persistent=False)
        self.counts: dict[str, float] = {}  # the last window's counts, by key

    @torch.no_grad()
    def update(self, values: dict[str, tuple[Tensor, Tensor | float]]) -> None:
        """``values``: key -> (sum over the batch, how many values it sums)."""
        index = [SUMMED.index(k) for k in values]
        sums = torch.stack([v[0].detach().to(self.sums.dtype).reshape(()) for v in values.values()])
        counts = torch.stack(
            [torch.as_tensor(v[1], dtype=self.sums.dtype, device=sums.device).reshape(()) for v in values.values()]
        )
        self.sums[:, index] += torch.stack([sums, counts]).to(self.sums)

    def compute_and_reset(self) -> dict[str, Tensor] | None:
        from lit_rlhf.utils.distributed import all_reduce_sum

        totals = all_reduce_sum(self.sums.clone())
        with torch.inference_mode(False):  # stays a normal tensor (validation runs in inference mode)
            self.sums = torch.zeros_like(self.sums, device=self.sums.device)
        counts = totals[1].tolist()
        self.counts = {k: counts[i] for i, k in enumerate(SUMMED)}
        out = {k: (totals[0, i] / counts[i]).float() for i, k in enumerate(SUMMED) if counts[i] > 0}
        if "rewards_chosen" in out and "rewards_rejected" in out:
            out["margins"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out or None


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
        # the cached log-probs replace the reference in training; SimPO and ORPO have none
        if not (config.precompute_ref_logprobs or config.reference_free):
            out.append(("reference", "frozen-ref", config.reference_path or config.policy_path))
        return out

    @classmethod
    def resolve_data_config(cls, config: DPOConfig, data: Any) -> Any:
        """KTO reads unpaired examples (``data.preference.unpaired``, docs/algorithms.md §5.3); every
        other loss reads pairs."""
        import dataclasses

        kto = not config.pair_loss.paired
        if not kto and data.unpaired:
            raise ConfigError(
                "data.preference.unpaired",
                f"unpaired examples train algo.loss_type=kto only; loss_type={config.loss_type!r} trains on pairs",
            )
        if not kto and data.format == "unpaired":
            raise ConfigError(
                "data.preference.format",
                f"unpaired rows (prompt, completion, label) train "
                f"algo.loss_type=kto only; loss_type={config.loss_type!r} "
                "trains on pairs",
            )
        return dataclasses.replace(data, unpaired=True) if kto else data

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
        if not (self.config.precompute_ref_logprobs or self.config.reference_free):  # SimPO, ORPO: no reference
            self.frozen["reference"] = self.build_reference()

    def exportable_model(self) -> nn.Module:
        return self.policy

    def on_fit_start(self) -> None:
        if self.config.precompute_ref_logprobs:
            self.ref_table = self.precompute_reference()
        for m in self.frozen.values():
            m.to(self.device)

    # --------------------------------------------------------------- log-probs
    def logps_of(self, model: nn.Module, batch: dict[str, Any], rows: slice = slice(None)) -> Tensor:
        """(N,) log-probs of the response tokens of ``rows`` of the batch, in ONE forward: packed
        without padding (``padding_free``), or right-padded."""
        return sequence_logprobs(
            model,
            batch["input_ids"][rows],
            batch["attention_mask"][rows],
            batch["response_mask"][rows],
            self.config.padding_free,
        )

    def sequence_logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(B,) chosen and (B,) rejected log-probs (KTO: completions and KL rows) of the response
        tokens, in ONE forward of the 2B stacked sequences."""
        logps = self.logps_of(model, batch)
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
                if hasattr(e, "chosen"):
                    h.update(
                        repr((split, e.chosen.prompt_ids, e.chosen.response_ids, e.rejected.response_ids)).encode()
                    )
                else:  # a KTO example and its KL row
                    h.update(
                        repr(
                            (
                                split,
                                e.completion.prompt_ids,
                                e.completion.response_ids,
                                e.kl.prompt_ids,
                                e.kl.response_ids,
                            )
                        ).encode()
                    )
        return h.hexdigest()

    # ------------------------------------------------------------------- steps
    def pair_loss(self, batch: dict[str, Any], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        """The configured loss of one batch (docs/algorithms.md §5, §5.1–§5.3), its metrics added to
        the split's window."""
        c: DPOConfig = self.config
        spec = c.pair_loss
        if not spec.paired:
            return self.kto_loss(batch, split)
        chosen, rejected = self.sequence_logps(self.policy, batch)
        if spec.logps == "mean":  # SimPO, ORPO: average per-token log-probs (§5.1, §5.2)
            lengths = batch["response_mask"].sum(1).clamp(min=1).to(chosen.dtype)
            inputs = [chosen / lengths[: chosen.shape[0]], rejected / lengths[chosen.shape[0] :]]
        else:
            inputs = [chosen, rejected]
        if spec.reference:
            inputs += self.reference_logps(batch, split)
        loss, stats = spec.fn(*inputs, **{name: getattr(c, name) for name in spec.params})
        n, cr, rr = chosen.shape[0], stats["chosen_rewards"], stats["rejected_rewards"]
        values = {
            "loss": (loss.detach() * n, n),
            "rewards_chosen": (cr.sum(), n),
            "rewards_rejected": (rr.sum(), n),
            "accuracies": ((cr > rr).sum(), n),
            "logps_chosen": (chosen.detach().sum(), n),
            "logps_rejected": (rejected.detach().sum(), n),
        }
        # a loss's own terms apart (ORPO's NLL and odds ratio, TRL's names)
        values.update({k: (stats[k] * n, n) for k in ("nll_loss", "log_odds_ratio", "log_odds_chosen") if k in stats})
        self.metrics_of(split).update(values)
        return loss, stats

    def kto_loss(self, batch: dict[str, Any], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        """KTO on a batch of unpaired examples (docs/algorithms.md §5.3): the policy scores the
        completions with grad and their KL rows without; z_ref averages the KL rows' log-ratios over
        every rank's batch (detached, clamped at 0)."""
        from lit_rlhf.utils.distributed import all_reduce_sum

        c: DPOConfig = self.config
        if "desirable" not in batch:
            raise ValueError(
                "algo.loss_type=kto needs unpaired batches (data.preference.unpaired=true, which the "
                "runner sets for KTO); this batch holds pairs"
            )
        desirable = batch["desirable"]
        b = desirable.shape[0]
        with torch.no_grad():  # first: the forward with gradient is then the last one before backward (FSDP, ZeRO-3)
            kl_logps = self.logps_of(self.policy, batch, slice(b, None))
        logps = self.logps_of(self.policy, batch, slice(0, b))
        ref_logps, ref_kl_logps = self.reference_logps(batch, split)
        z_ref = kto_reference_point(kl_logps, ref_kl_logps, reduce=all_reduce_sum)
        params = {name: getattr(c, name) for name in c.pair_loss.params}
        loss, stats = c.pair_loss.fn(logps, ref_logps, desirable, z_ref, **params)
        good = desirable.to(logps.dtype)
        bad, rewards, lp = 1.0 - good, stats["rewards"], logps.detach()
        self.metrics_of(split).update(
            {
                "loss": (loss.detach() * b, b),
                "rewards_chosen": ((rewards * good).sum(), good.sum()),
                "rewards_rejected": ((rewards * bad).sum(), bad.sum()),
                "logps_chosen": ((lp * good).sum(), good.sum()),
                "logps_rejected": ((lp * bad).sum(), bad.sum()),
                "kl": (z_ref, 1.0),
            }
        )
        return loss, stats

    def metrics_of(self, split: str) -> DPOMetrics:
        return {"train": self.train_metrics, "val": self.val_metrics, "test": self.test_metrics}[split]

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, _ = self.pair_loss(batch, "train")
        window = max(1, int(self.trainer.log_every_n_steps or 1))
        if (batch_idx + 1) % window == 0 or self.trainer.is_last_batch:
            values = self.train_metrics.compute_and_reset()
            if values is not None:  # the window's aggregate over all ranks
                names = _names("", {k: v for k, v in values.items() if k != "loss"})
                self.log_dict(
                    {
                        **names,
                        "train/loss": values["loss"],
                        "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                    },
                    sync_dist=False,
                )
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        self.pair_loss(batch, "val")
        return self.drift_rollout(batch, batch_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.pair_loss(batch, "test")

    def on_test_epoch_end(self) -> None:
        """Held-out implicit-reward accuracy with its 95% Wilson interval (as the reward model's)."""
        from lit_rlhf.modules.reward_model import wilson_interval

        values = self.test_metrics.compute_and_reset()
        if values is None:
            return
        extra = {}
        if "accuracies" in values:  # pairs (KTO's unpaired examples have no accuracy)
            pairs = self.test_metrics.counts["accuracies"]
            low, high = wilson_interval(float(values["accuracies"]) * pairs, int(pairs))
            extra = {"test/accuracy_ci_low": low, "test/accuracy_ci_high": high, "test/pairs": pairs}
        self.log_dict({**_names("test/", values), **extra}, sync_dist=False)

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
        self.engine_sleep()  # a vllm engine's GPU memory goes back to training until the next drift rollout

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
            rollout = generate_and_score(
                self.policy,
                prompts,
                self.tokenizer,
                self.config.generation,
                reference=self.frozen.get("reference"),
                padding_free=self.config.padding_free,
                engine=self.rollout_engine(self.policy),
            )
        return {"rollout": rollout.normal_tensors()}
