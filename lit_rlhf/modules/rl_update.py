"""The update side of the one RL iteration (docs/architecture.md "One RL iteration"), mixed into
:class:`~lit_rlhf.modules.rl.RLModule`: the policy's training forward, β·KL for the loss, the passes
× minibatches of one backward + one step each (non-finite losses and gradients skipped and counted),
the β controller's input, and the iteration's statistics over minibatches and ranks. Kept apart
from rl.py (the iteration's order, models, rollouts, logging and state) only for length; it reads
the same attributes (``actor``, ``critic``, ``config``, ``kl_ctl``, ``health``, ``iteration``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.core.kl import AdaptiveKLController, kl_penalty, sequence_kl
from lit_rlhf.core.losses import aggregate
from lit_rlhf.core.mismatch import truncated_is_weights
from lit_rlhf.core.types import Rollout
from lit_rlhf.modules.health import all_ranks_finite
from lit_rlhf.rollout.minibatches import iterate_minibatches
from lit_rlhf.rollout.score import response_logprobs, response_values
from lit_rlhf.utils.distributed import all_reduce_max, all_reduce_sum


@dataclass
class PolicyForward:
    """One training forward of the policy (and the critic, when the stage has one) over a minibatch, with grad."""

    logprobs: Tensor  # (B, R) log π_θ(y_t | x, y_<t)
    entropy: Tensor  # (B, R) H(π_θ(·|s_t)); in the graph only when the entropy is in the loss
    values: Tensor | None  # (B, R) V_θ(s_t); None without a critic


def has_dropout(module: nn.Module | None) -> bool:
    """Any active dropout (nn.Dropout p > 0, or a transformers config attention/hidden dropout)."""
    if module is None:
        return False
    for m in module.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        config = getattr(m, "config", None)
        if config is not None and any(
            getattr(config, k, 0) or 0 for k in ("attention_dropout", "hidden_dropout", "dropout")
        ):
            return True
    return False


class RLUpdateMixin:
    """Policy forward, KL term, minibatch updates and statistics of an RL stage (see the module docstring)."""

    # ------------------------------------------------------------------ update
    def policy_forward(self, mb: Rollout) -> PolicyForward:
        """Policy log-probs and entropies (and critic values) of a minibatch, with grad."""
        ids, mask, width = mb.input_ids, mb.attention_mask, mb.prompt_ids.shape[1]
        # the entropy needs a graph only when it is in the loss; otherwise it is a statistic
        logprobs, entropy = response_logprobs(
            self.actor,
            ids,
            mask,
            width,
            self.logprob_temperature(),
            with_entropy=True,
            entropy_grad=self.entropy_in_loss(),
            padding_free=self.config.padding_free,
        )
        values = response_values(self.critic, ids, mask, width) if self.critic is not None else None
        return PolicyForward(logprobs, entropy, values)

    def importance_weights(self, mb: Rollout, mask: Tensor) -> Tensor | None:
        """Per-token truncated importance weights min(π_old/π_sampler, C) of a minibatch with
        ``algo.rollout_correction=tis`` (docs/algorithms.md §2.10), for the policy-gradient term of
        every RL stage's loss; None without a correction."""
        if self.config.rollout_correction != "tis":
            return None
        return truncated_is_weights(
            mb.logprobs, mb.require("sampler_logprobs").sampler_logprobs, mask, self.config.tis_cap
        )

    def kl_loss(
        self,
        logprobs: Tensor,
        mb: Rollout,
        mask: Tensor,
        aggregation: str = "token_mean",
        constant: float | None = None,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """β · KL(π_θ‖π_ref) for the loss (GRPO's k3, PPO's ``kl_placement=loss``), β from
        :attr:`kl_ctl` — the same β the collapse alarm raises and ``kl_ctl/beta`` logs. None
        while β = 0 or without a reference."""
        beta = self.kl_ctl.value
        if not beta or mb.ref_logprobs is None:
            return None, {}
        kl = aggregate(
            kl_penalty(logprobs, mb.ref_logprobs, self.config.kl_estimator, mask=mask), mask, aggregation, constant
        )
        return beta * kl, {"policy/kl_loss": kl.detach()}

    def update(self, rollout: Rollout, ptx: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """:meth:`num_passes` × shuffled minibatches of one backward + one optimizer step each
        (the fused path: one step on the whole rollout, in order, from the kept first forward).
        ``ptx`` (PPO-ptx's SFT batch) is split into as many chunks as there are minibatches."""
        opt, sched = self.optimizers(), self.lr_schedulers()
        first, self._first_forward = self._first_forward, None
        n = rollout.scores.shape[0]
        if first is not None:
            minibatches = [torch.arange(n)]
        else:
            gen = torch.Generator().manual_seed(int(self.trainer.current_epoch * 1_000_003 + self.iteration))
            minibatches = list(iterate_minibatches(n, self.minibatch_rows(n), self.num_passes(), gen))
        ptx_chunks = None
        if ptx is not None and getattr(self.config, "ptx_coef", 0.0):
            rows = torch.arange(ptx["input_ids"].shape[0]).chunk(len(minibatches))
            ptx_chunks = [{k: v[r] for k, v in ptx.items()} for r in rows]
        collected: dict[str, list[Tensor]] = {}
        for i, idx in enumerate(minibatches):
            if self.max_steps_reached():
                break
            mb = rollout if first is not None else rollout.select(idx.to(rollout.scores.device))
            chunk = ptx_chunks[i % len(ptx_chunks)] if ptx_chunks else None
            loss, stats = self.minibatch_loss(mb, first or self.policy_forward(mb), chunk)
            self.optimizer_step(opt, sched, loss)
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.detach().float())
        return self.mean_stats(collected)

    @torch.no_grad()
    def update_kl_controller(self, rollout: Rollout) -> None:
        """Feed an adaptive β controller the mean sequence KL of ALL ranks' rollouts, so that β
        stays the same on every rank (a fixed β needs no input: no collective then)."""
        if not isinstance(self.kl_ctl, AdaptiveKLController) or rollout.ref_logprobs is None:
            return
        kl_seq = sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.valid_mask, self.config.kl_estimator)
        kl_sum_n = all_reduce_sum(torch.stack([kl_seq.sum(), kl_seq.new_tensor(float(kl_seq.shape[0]))]).float())
        self.kl_ctl.update(float(kl_sum_n[0] / kl_sum_n[1]), int(kl_sum_n[1]))

    # ------------------------------------------------------------ iterations
    def max_steps_reached(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps >= 0 and self.global_step >= max_steps

    def optimizer_step(self, opt: Any, sched: Any, loss: Tensor) -> bool:
        """zero_grad → backward → global grad-norm clip (DeepSpeed clips in its own config) → step.

        A loss that is not finite on some rank, or a non-finite gradient norm, is skipped and
        counted: no optimizer or schedule step (lit_rlhf/modules/health.py). The norm is computed
        once for the check and the clip, across shards under FSDP
        (:func:`lit_rlhf.runtime.strategies.sharded_grad_norm`), so every rank decides alike. Under
        DeepSpeed the gradients live in the engine: only the loss is checked there. Returns
        whether the update was applied.
        """
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lit_rlhf.runtime.strategies import sharded_grad_norm

        strategy = self.trainer.strategy
        max_norm = self.config.max_grad_norm
        opt.zero_grad()
        applied = all_ranks_finite(loss.detach())
        if applied:
            self.manual_backward(loss)
            if not isinstance(strategy, DeepSpeedStrategy):
                params = [p for group in opt.param_groups for p in group["params"]]
                norm = sharded_grad_norm(params, strategy)
                applied = bool(torch.isfinite(norm))
                if applied and max_norm is not None:
                    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        if applied:
            opt.step()
            sched.step()
        else:
            opt.zero_grad()
        self.health.count_update(applied)
        return applied

    @staticmethod
    def mean_stats(collected: dict[str, list[Tensor]]) -> dict[str, Tensor]:
        """An iteration's statistics over its minibatches: means, except ``policy/ratio_max`` (the max)."""
        out = {k: torch.stack(v).mean() for k, v in collected.items()}
        if "policy/ratio_max" in collected:
            out["policy/ratio_max"] = torch.stack(collected["policy/ratio_max"]).max()
        return out

    def stats_over_ranks(self, stats: dict[str, Tensor]) -> dict[str, Tensor]:
        """An iteration's statistics over all ranks, so that every rank logs (and its callbacks
        read) the whole batch's: each rank's value is of its own rollout, the same size on every
        rank, so the mean of the ranks' values is the global one; ``*_max`` ones take the maximum.
        Two all-reduces an iteration; alone, ``stats`` unchanged."""
        world = self._trainer.world_size if self._trainer is not None else 1
        if world <= 1:
            return stats
        keys = sorted(stats)
        values = torch.stack([stats[k].detach().float().reshape(()).to(self.device) for k in keys])
        means = all_reduce_sum(values.clone()) / world
        maxima = all_reduce_max(values.clone())
        return {k: (maxima[i] if k.endswith("_max") else means[i]) for i, k in enumerate(keys)}
