"""``GRPOModule``: critic-free RL — GRPO, and DAPO, Dr. GRPO, RLOO as its presets (docs/algorithms.md §6).

One RL iteration per ``training_step``, through the same rollout path as PPO:

1. :meth:`collect`: G responses per prompt (``num_generations``), scored by the reward model or
   the weighted reward callables; with DAPO's dynamic sampling, groups whose rewards are all equal
   are dropped and more prompts are sampled until the batch is full (up to ``max_resample_rounds``);
2. :meth:`compute_advantages`: optional overlong shaping of the reward, then group-relative
   advantages (mean or leave-one-out baseline, optionally scaled by the group std) broadcast to
   every response token; responses with a non-finite reward are counted and left out;
3. :meth:`update`: ``num_iterations`` passes of the clipped surrogate (ε_low, ε_high) + β·KL(π‖π_ref)
   in the LOSS (k3), aggregated per sequence, per token, or over a constant (Dr. GRPO).

No critic. β = 0 loads no reference model (the KL monitors then report nothing).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.advantages import group_advantages
from lit_rlhf.core.kl import kl_penalty
from lit_rlhf.core.losses import aggregate, ppo_policy_loss
from lit_rlhf.core.rewards import overlong_penalty
from lit_rlhf.core.types import Rollout, cat_rollouts
from lit_rlhf.modules.configs import GRPOConfig
from lit_rlhf.modules.ppo import PolicyForward
from lit_rlhf.modules.rl import RLModule
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.rollout.minibatches import iterate_minibatches
from lit_rlhf.rollout.score import response_logprobs
from lit_rlhf.utils.distributed import all_reduce_min, all_reduce_sum

AGGREGATION = {"seq_mean_token_mean": "seq_mean", "token_mean": "token_mean", "seq_sum_constant": "seq_sum_const"}


class GRPOModule(RLModule):
    """Group-relative policy optimization of ``self.actor``; ``data_kind = "prompt"``."""

    config_class = GRPOConfig

    def __init__(self, config: GRPOConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self._first_forward: PolicyForward | None = None  # the fused path's, for update()
        self._extra_prompts: Any = None  # dynamic sampling's own prompt stream
        self.extra_batches = 0  # prompt batches drawn from it (checkpointed: a resume skips them)

    @classmethod
    def prompts_per_iteration(cls, config: GRPOConfig) -> int:
        return config.rollout_batch_size // config.num_generations

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        if self.actor is not None:
            return
        from lit_rlhf.models.builders import build_causal_lm, freeze

        tok = self.ensure_tokenizer()
        self.actor = self.with_lora(build_causal_lm(self.model_spec, tok)).train()
        if self.config.kl_coef > 0:  # β = 0: no reference model at all
            self.frozen["reference"] = self.reference_for(self.actor, lambda: freeze(build_causal_lm(self.model_spec, tok)))
        self.build_rewards()

    def configure_optimizers(self) -> Any:
        optimizer = self.build_optimizer(self.decay_groups(self.actor))
        return {"optimizer": optimizer, "lr_scheduler": self.build_scheduler(optimizer, self.total_updates())}

    # --------------------------------------------------------------- the step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        started = time.perf_counter()
        rollout, stats = self.collect(batch)
        collected = time.perf_counter()
        stats.update(self.compute_advantages(rollout))
        stats.update(self.update(rollout))
        return self.end_iteration(rollout, stats, started, collected)

    # --------------------------------------------------------------- phase 1
    def sample_groups(self, batch: dict[str, Any], policy_logprobs: bool = True) -> Rollout:
        """G responses to each prompt of ``batch`` (rows of a group are consecutive), scored."""
        g = self.config.num_generations
        group = {"prompt_ids": batch["prompt_ids"].repeat_interleave(g, 0),
                 "prompt_mask": batch["prompt_mask"].repeat_interleave(g, 0),
                 "prompts": [p for p in batch["prompts"] for _ in range(g)]}  # fmt: skip
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor, group, self.tokenizer, self.config.generation, reference=self.frozen.get("reference"),
                scorer=self.scorer, policy_logprobs=policy_logprobs, logprob_temperature=self.logprob_temperature(),
                padding_free=self.config.padding_free,
            )  # fmt: skip
        return rollout.normal_tensors()

    def collect(self, batch: dict[str, Any]) -> tuple[Rollout, dict[str, Tensor]]:
        """The iteration's rollout (complete: the old log-probs too) and its sampling statistics."""
        c: GRPOConfig = self.config
        fused = self.fused_first_forward()
        rollout = self.sample_groups(batch, policy_logprobs=not fused)
        stats: dict[str, Tensor] = {}
        if c.dynamic_sampling:
            rollout, stats = self.dynamic_sampling(rollout, batch["prompt_ids"].shape[0], fused)
        if fused:  # the update's first forward scores the policy (exact: the same weights)
            self._first_forward = self.policy_forward(rollout)
            rollout.logprobs = self._first_forward.logprobs.detach()
        return rollout.require("logprobs", "scores"), stats

    def fused_first_forward(self) -> bool:
        """One pass over one minibatch: the rollout weights ARE the update's, so log π_old is the
        first training forward's, detached (TRL computes it the same way)."""
        c: GRPOConfig = self.config
        return c.num_iterations == 1 and (c.minibatch_size is None or c.minibatch_size >= c.rollout_batch_size)

    def dynamic_sampling(self, rollout: Rollout, groups_wanted: int, fused: bool) -> tuple[Rollout, dict[str, Tensor]]:
        """DAPO: keep the groups whose rewards differ; sample more prompts (their own stream) until
        ``groups_wanted`` groups are kept or ``max_resample_rounds`` extra batches were drawn.
        Under several processes every rank samples again while any rank is short (sampling is
        collective), and all ranks train on the fewest groups any rank kept."""
        c: GRPOConfig = self.config
        g = c.num_generations
        kept, dropped, rounds = [], 0, 0
        while True:
            signal = ~group_advantages(rollout.scores, g)[1]  # (groups,) rewards not all equal
            rows = signal.repeat_interleave(g).nonzero().squeeze(-1)
            dropped += int((~signal).sum())
            if rows.numel():
                kept.append(rollout.select(rows))
            short = sum(r.scores.shape[0] for r in kept) < groups_wanted * g
            # every rank samples again while ANY rank is short: sampling is collective (the decoding
            # loop's step agreement, gathered weights), and the extra-prompt streams stay in step
            if not bool(all_reduce_sum(torch.tensor(float(short), device=rollout.scores.device))) \
                    or rounds >= c.max_resample_rounds:
                break
            rounds += 1
            rollout = self.sample_groups(self.next_extra_prompts(), policy_logprobs=not fused)
        if not kept:  # no group had a signal: train on the last batch (zero advantages: only the KL acts)
            kept = [rollout]
        out = cat_rollouts(kept, self.tokenizer.pad_token_id)
        # every rank trains on as many groups (the fewest any rank has): the update's minibatch
        # count, hence its collectives (gradient all-reduces), must agree
        n = torch.tensor(min(out.scores.shape[0], groups_wanted * g), device=out.scores.device)
        out = out.select(torch.arange(int(all_reduce_min(n))))
        n_groups = out.scores.shape[0] // g
        return out, {"grpo/dropped_groups": torch.tensor(float(dropped)), "grpo/resample_rounds": torch.tensor(float(rounds)),
                     "grpo/kept_groups": torch.tensor(float(n_groups))}  # fmt: skip

    def next_extra_prompts(self) -> dict[str, Any]:
        if self._extra_prompts is None:
            loader = self.trainer.datamodule.extra_dataloader()
            self._extra_prompts = _cycle(loader, skip=self.extra_batches)
        self.extra_batches += 1
        batch = next(self._extra_prompts)
        return self.trainer.strategy.batch_to_device(batch)

    # --------------------------------------------------------------- phase 2
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Overlong shaping, group-relative advantages (docs/algorithms.md §6), broadcast to tokens."""
        c: GRPOConfig = self.config
        self.health.count_scores(rollout.scores)
        valid = torch.isfinite(rollout.scores)
        rewards = rollout.scores
        if c.overlong_buffer is not None:
            max_length = c.overlong_max_length or c.generation.max_new_tokens
            rewards = rewards + overlong_penalty(rollout.response_lengths, max_length, c.overlong_buffer)
        adv, no_signal = group_advantages(rewards, c.num_generations, c.scale_rewards, c.advantage_baseline, 1e-4, valid)
        rollout.advantages = adv[:, None] * rollout.response_mask
        stats = {"grpo/zero_std_groups": no_signal.float().mean(),
                 "reward/shaped_mean": rewards[valid].mean() if valid.any() else rewards.new_tensor(0.0)}  # fmt: skip
        components = getattr(self.scorer, "components", {})
        stats.update({f"reward/{name}": v[torch.isfinite(v)].mean() for name, v in components.items()})
        return stats

    # --------------------------------------------------------------- phase 3
    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        c: GRPOConfig = self.config
        n = c.rollout_batch_size if batch_size is None else batch_size
        return c.num_iterations * -(-n // (c.minibatch_size or n))

    def policy_forward(self, mb: Rollout) -> PolicyForward:
        logprobs, entropy = response_logprobs(self.actor, mb.input_ids, mb.attention_mask, mb.prompt_ids.shape[1],
                                              self.logprob_temperature(), with_entropy=True, entropy_grad=False,
                                              padding_free=self.config.padding_free)  # fmt: skip
        return PolicyForward(logprobs, entropy, logprobs.new_zeros(()))  # no critic

    def minibatch_loss(self, mb: Rollout, fwd: PolicyForward) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate + β·KL in the loss, both with the configured aggregation."""
        c: GRPOConfig = self.config
        mask = mb.valid_mask  # responses without a finite reward are left out
        agg, constant = AGGREGATION[c.loss_aggregation], float(c.generation.max_new_tokens)
        loss, pg = ppo_policy_loss(fwd.logprobs, mb.logprobs, mb.advantages, mask, c.clip_eps_low, c.clip_eps_high,
                                   None, agg, constant)  # fmt: skip
        stats = {f"policy/{k}": v for k, v in pg.items()}
        stats["policy/entropy"] = (fwd.entropy * mask).sum() / mask.sum().clamp(min=1)
        if c.kl_coef > 0:
            kl = aggregate(kl_penalty(fwd.logprobs, mb.ref_logprobs, c.kl_estimator), mask, agg, constant)
            loss = loss + c.kl_coef * kl
            stats["policy/kl_loss"] = kl.detach()
        return loss, stats

    def update(self, rollout: Rollout) -> dict[str, Tensor]:
        """``num_iterations`` passes over the rollout in minibatches, one backward + step each."""
        c: GRPOConfig = self.config
        opt, sched = self.optimizers(), self.lr_schedulers()
        first, self._first_forward = self._first_forward, None
        n = rollout.scores.shape[0]
        if first is not None:
            minibatches = [torch.arange(n)]
        else:
            gen = torch.Generator().manual_seed(int(self.trainer.current_epoch * 1_000_003 + self.iteration))
            minibatches = list(iterate_minibatches(n, c.minibatch_size or n, c.num_iterations, gen))
        collected: dict[str, list[Tensor]] = {}
        for idx in minibatches:
            if self.max_steps_reached():
                break
            mb = rollout if first is not None else rollout.select(idx.to(rollout.scores.device))
            loss, stats = self.minibatch_loss(mb, first or self.policy_forward(mb))
            self.optimizer_step(opt, sched, loss)
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.detach().float())
        return self.mean_stats(collected)

    # -------------------------------------------------------------- state
    def rl_state_dict(self) -> dict[str, Any]:
        return {**super().rl_state_dict(), "extra_batches": self.extra_batches}

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        super().load_rl_state_dict(state)
        self.extra_batches = int(state.get("extra_batches", 0))
        self._extra_prompts = None  # recreated on demand, past the batches already drawn


def _cycle(loader: Any, skip: int = 0) -> Any:
    """Batches of ``loader`` forever, after skipping the first ``skip``. Pass ``k`` is the
    sampler's epoch ``k`` (a new order each pass, a function of the seed and ``k`` only), so a
    resumed run continues the same sequence."""
    per_pass = len(loader)
    if per_pass == 0:
        raise ValueError("the extra prompt loader is empty (fewer training prompts than one batch per rank)")
    epoch, skip = divmod(skip, per_pass)
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        skip = 0
        epoch += 1
