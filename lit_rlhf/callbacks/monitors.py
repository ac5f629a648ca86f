"""Rollout monitors: KL to the reference, perplexity, response length, reward distribution, samples.

Each reads ``outputs["rollout"]`` of ``on_train_batch_end`` (the dict an RL stage's
``training_step`` returns; Lightning's manual loop passes it through), aggregates with
torchmetrics over ``every_n_steps`` RL iterations — sums, not means of means, so the values are
exact across batches and ranks — and logs under the names of docs/metrics.md. Outside RL stages
(no rollout in the outputs) they do nothing.

Definitions (docs/algorithms.md §4), with k1_t = log π(y_t|·) − log π_ref(y_t|·) on response tokens:
  stability/kl            mean over samples of Σ_t k1_t  (sequence KL)
  stability/kl_per_token  Σ k1 / Σ tokens                (what MOSS-RLHF logs as ``ref_kl``)
  stability/kl_k3         mean over samples of Σ_t min(e^{−d_t} + d_t − 1, 10), d_t = k1_t clamped to ±20
  stability/perplexity    exp(−Σ log π / Σ tokens) over response tokens (…_ref: under π_ref)
  stability/response_length, …_max, stability/truncation_rate (no EOS within max_new_tokens)
  reward/score_mean, reward/score_std, reward/score_q05…q95, reward/tail_ratio = (q95 − q50)/(q50 − q05)
                          (over the finite scores), reward/nonfinite (NaN/inf scores: counted, not used)
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import CatMetric, MaxMetric, SumMetric

from lit_rlhf.core.kl import sequence_kl
from lit_rlhf.core.masked import masked_sum
from lit_rlhf.utils.loggers import log_histogram, wandb_loggers

log = logging.getLogger(__name__)


def _rollout(outputs: Any) -> Any:
    return outputs.get("rollout") if isinstance(outputs, dict) else None


class RolloutMonitor(pl.Callback):
    """Base class: ``update`` per RL iteration, ``compute`` + log + reset every ``every_n_steps``.

    Rollouts a stage returns from ``validation_step`` (DPO's drift samples) are aggregated over the
    whole validation epoch, in their own metric state, and logged once at its end.
    """

    prog_bar: tuple[str, ...] = ()

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        self.every_n_steps = every_n_steps
        self.metrics: nn.ModuleDict | None = None  # the state update()/compute() work on
        self._states: dict[str, nn.ModuleDict] = {}
        self._seen = 0

    # subclasses -----------------------------------------------------------
    def build(self) -> dict[str, nn.Module]:
        raise NotImplementedError

    def update(self, rollout: Any) -> None:
        raise NotImplementedError

    def compute(self) -> dict[str, Tensor]:
        raise NotImplementedError

    # lightning -------------------------------------------------------------
    def _use(self, phase: str, device: Any) -> None:
        if phase not in self._states:
            self._states[phase] = nn.ModuleDict(self.build())
        self.metrics = self._states[phase].to(device)

    def _compute_and_reset(self) -> dict[str, Tensor]:
        values = self.compute()
        with torch.inference_mode(False):  # fresh states must be normal tensors (validation runs in inference mode)
            for m in self.metrics.values():
                m.reset()
        return values

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollout = _rollout(outputs)
        if rollout is None:
            return
        self._use("train", rollout.response_mask.device)
        self.update(rollout)
        self._seen += 1
        if self._seen % self.every_n_steps == 0:
            self.log_values(trainer, pl_module, self._compute_and_reset())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        rollout = _rollout(outputs)
        if rollout is not None:
            self._use("val", rollout.response_mask.device)
            self.update(rollout)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        state = self._states.get("val")
        if state is None or not any(m.update_count for m in state.values()):
            return
        self._use("val", pl_module.device)
        for name, value in self._compute_and_reset().items():
            pl_module.log(name, value.float(), on_step=False, on_epoch=True, sync_dist=False)

    def log_values(self, trainer, pl_module, values: dict[str, Tensor]) -> None:
        for name, value in values.items():
            pl_module.log(
                name, value.float(), on_step=True, on_epoch=False, prog_bar=name in self.prog_bar, sync_dist=False
            )  # already reduced across ranks by torchmetrics


class KLMonitor(RolloutMonitor):
    """KL(π‖π_ref) of the sampled responses: sequence KL (k1 sum), per-token mean, and k3."""

    prog_bar = ("stability/kl",)

    def build(self) -> dict[str, nn.Module]:
        return {"kl_sum": SumMetric(), "k3_sum": SumMetric(), "samples": SumMetric(), "tokens": SumMetric()}

    def update(self, rollout: Any) -> None:
        if rollout.ref_logprobs is None:  # no reference model (e.g. GRPO with β = 0): no KL to report
            return
        mask = rollout.response_mask
        logprobs, ref = rollout.logprobs.float(), rollout.ref_logprobs.float()
        m = self.metrics
        m["kl_sum"].update(sequence_kl(logprobs, ref, mask, "k1", clamp=None).sum())  # exact log-ratios
        m["k3_sum"].update(sequence_kl(logprobs, ref, mask, "k3").sum())
        m["samples"].update(torch.tensor(float(mask.shape[0]), device=mask.device))
        m["tokens"].update(mask.sum().float())

    def compute(self) -> dict[str, Tensor]:
        m = self.metrics
        if m["samples"].update_count == 0:
            return {}
        samples, tokens = m["samples"].compute(), m["tokens"].compute().clamp(min=1)
        return {
            "stability/kl": m["kl_sum"].compute() / samples,
            "stability/kl_per_token": m["kl_sum"].compute() / tokens,
            "stability/kl_k3": m["k3_sum"].compute() / samples,
        }


class PerplexityMonitor(RolloutMonitor):
    """exp(Σ NLL / Σ tokens) of the responses under the policy (at rollout) and the reference."""

    def build(self) -> dict[str, nn.Module]:
        return {"nll": SumMetric(), "nll_ref": SumMetric(), "tokens": SumMetric()}

    def update(self, rollout: Any) -> None:
        mask = rollout.response_mask
        self.metrics["nll"].update(-masked_sum(rollout.logprobs.float(), mask))
        if rollout.ref_logprobs is not None:
            self.metrics["nll_ref"].update(-masked_sum(rollout.ref_logprobs.float(), mask))
        self.metrics["tokens"].update(mask.sum().float())

    def compute(self) -> dict[str, Tensor]:
        tokens = self.metrics["tokens"].compute().clamp(min=1)
        out = {"stability/perplexity": torch.exp(self.metrics["nll"].compute() / tokens)}
        if self.metrics["nll_ref"].update_count:
            out["stability/perplexity_ref"] = torch.exp(self.metrics["nll_ref"].compute() / tokens)
        return out


class ResponseLengthMonitor(RolloutMonitor):
    """Response length in tokens (EOS included): mean, max, and the share truncated without EOS."""

    prog_bar = ("stability/response_length",)

    def build(self) -> dict[str, nn.Module]:
        return {"length": SumMetric(), "max": MaxMetric(), "samples": SumMetric(), "truncated": SumMetric()}

    def update(self, rollout: Any) -> None:
        lengths = rollout.response_mask.sum(-1).float()
        self.metrics["length"].update(lengths.sum())
        self.metrics["max"].update(lengths.max())
        self.metrics["samples"].update(torch.tensor(float(lengths.numel()), device=lengths.device))
        self.metrics["truncated"].update((~rollout.ended.bool()).float().sum())

    def compute(self) -> dict[str, Tensor]:
        n = self.metrics["samples"].compute()
        return {
            "stability/response_length": self.metrics["length"].compute() / n,
            "stability/response_length_max": self.metrics["max"].compute(),
            "stability/truncation_rate": self.metrics["truncated"].compute() / n,
        }


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


class RewardStatsMonitor(RolloutMonitor):
    """Raw score distribution: mean, std, quantiles, tail ratio; a histogram on W&B/TensorBoard;
    every iteration's scores appended to ``<run dir>/reward_scores.jsonl`` (the PNG report's
    histogram over time)."""

    prog_bar = ("reward/score_mean",)

    def __init__(self, every_n_steps: int = 1, scores_file: str | None = "reward_scores.jsonl") -> None:
        super().__init__(every_n_steps)
        self.scores_file = scores_file

    def build(self) -> dict[str, nn.Module]:
        # non-finite scores are counted, never silently dropped (CatMetric would drop NaN with a warning)
        return {"scores": CatMetric(nan_strategy="disable"), "nonfinite": SumMetric()}

    def update(self, rollout: Any) -> None:
        if rollout.scores is None:  # (DPO's drift samples have no reward)
            return
        scores = rollout.scores.detach().float()
        finite = torch.isfinite(scores)
        self.metrics["nonfinite"].update((~finite).sum().float())
        if finite.any():
            self.metrics["scores"].update(scores[finite])

    def compute(self) -> dict[str, Tensor]:
        if self.metrics["scores"].update_count == 0:
            return (
                {"reward/nonfinite": self.metrics["nonfinite"].compute()}
                if self.metrics["nonfinite"].update_count
                else {}
            )
        s = self.metrics["scores"].compute().flatten().float()
        q = torch.quantile(s, torch.tensor(QUANTILES, device=s.device))
        out = {"reward/score_mean": s.mean(), "reward/score_std": s.std(unbiased=False)}
        out.update({f"reward/score_q{int(round(p * 100)):02d}": v for p, v in zip(QUANTILES, q)})
        out["reward/tail_ratio"] = (q[4] - q[2]) / (q[2] - q[0]).clamp(min=1e-6)
        out["reward/nonfinite"] = self.metrics["nonfinite"].compute()
        self._last_scores = s
        return out

    def log_values(self, trainer, pl_module, values: dict[str, Tensor]) -> None:
        super().log_values(trainer, pl_module, values)
        if "reward/score_mean" not in values or not trainer.is_global_zero:
            return
        scores = self._last_scores.cpu()
        step = pl_module.rl_iteration
        log_histogram(trainer.loggers, "reward/score_hist", scores, step, step_key="rl/iteration")
        run_dir = trainer.default_root_dir
        if self.scores_file and run_dir:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, self.scores_file), "a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "step": step,
                            "scores": [round(float(x), 6) for x in scores],
                            "nonfinite": int(values["reward/nonfinite"]),
                        }
                    )
                    + "\n"
                )


class SamplesTable(pl.Callback):
    """Every ``every_n_steps`` RL iterations: (step, prompt, response, score, kl, length) of up to
    ``max_rows`` samples, appended to ``<run dir>/samples.jsonl`` (any logger) and logged as a
    W&B Table when W&B is on. Rank zero's samples only."""

    def __init__(self, every_n_steps: int = 10, max_rows: int = 8, filename: str = "samples.jsonl") -> None:
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.filename = filename
        self._seen = 0
        self._rows: list[list[Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollout = _rollout(outputs)
        if rollout is None:
            return
        self._seen += 1
        if (self._seen - 1) % self.every_n_steps or not trainer.is_global_zero:
            return
        step = pl_module.rl_iteration
        kl = None
        if rollout.ref_logprobs is not None:
            kl = sequence_kl(rollout.logprobs.float(), rollout.ref_logprobs.float(), rollout.response_mask, clamp=None)
        rows = []
        n = min(self.max_rows, rollout.scores.shape[0])
        for i in range(n):
            rows.append(
                [
                    step,
                    _as_text(rollout.prompts_text[i]) if rollout.prompts_text else "",
                    rollout.responses_text[i] if rollout.responses_text else "",
                    float(rollout.scores[i]),
                    float(kl[i]) if kl is not None else None,
                    int(rollout.response_mask[i].sum()),
                ]
            )
        columns = ["step", "prompt", "response", "score", "kl", "length"]
        if trainer.default_root_dir:
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            with open(os.path.join(trainer.default_root_dir, self.filename), "a") as fh:
                for r in rows:
                    fh.write(json.dumps(dict(zip(columns, r))) + "\n")
        self._rows.extend(rows)
        for lg in wandb_loggers(trainer.loggers):
            import wandb

            # a W&B Table is immutable once logged: log the cumulative table under one key
            lg.experiment.log({"samples": wandb.Table(columns=columns, data=self._rows), "rl/iteration": step})


def _as_text(prompt: Any) -> str:
    """A raw prompt for the samples table: its text, or a conversation (template=auto) one
    ``role: content`` line per message."""
    return prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
