"""``PPOModule``: PPO / PPO-max for language models with manual optimization (docs/algorithms.md §2–§3).

The RL iteration is :class:`~lit_rlhf.modules.rl.RLModule`'s (collect → advantages → update →
β controller); PPO supplies what differs:

* a critic (a value head on a causal trunk, initialised from the reward model or the policy),
  scored in the rollout and trained with the actor;
* :meth:`compute_advantages`: score reparameterization → per-token rewards (score on the EOS,
  −β·kl) → GAE → whitening (across ranks);
* :meth:`minibatch_loss`: clipped policy loss (+ entropy, + KL in the loss, + PPO-ptx) and the
  clipped value loss, summed: ONE ``manual_backward`` and ONE optimizer with two parameter
  groups (own lr each) — the arrangement that works under DDP without
  ``find_unused_parameters`` and under DeepSpeed, which accepts a single optimizer.

``trainer.max_steps`` counts optimizer steps (Lightning's meaning): an iteration performs
``ppo_epochs × ceil(batch / minibatch_size)`` of them and training stops exactly at the limit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.advantages import gae
from lit_rlhf.core.kl import kl_penalty
from lit_rlhf.core.logprobs import shifted_token_logprobs
from lit_rlhf.core.losses import entropy_loss, ptx_loss, value_loss
from lit_rlhf.core.masked import masked_whiten
from lit_rlhf.core.running_stats import RunningMoments
from lit_rlhf.core.shaping import penalize_missing_eos, reparameterize_scores, shape_rewards
from lit_rlhf.core.types import Rollout
from lit_rlhf.modules.configs import PPOConfig
from lit_rlhf.modules.rl import LossCounts, PolicyForward, RLModule
from lit_rlhf.utils.distributed import all_reduce_sum

log = logging.getLogger(__name__)


class PPOModule(RLModule):
    """PPO over (actor, critic) with a frozen reference and reward. ``data_kind = "prompt"``."""

    config_class = PPOConfig
    model_path_keys = ("policy_path", "reward_path", "critic_path")

    def __init__(self, config: PPOConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        c: PPOConfig = self.config
        self.reward_moments = RunningMoments()
        if c.minibatch_size is not None and c.minibatch_size > c.rollout_batch_size:
            log.warning(
                "algo.minibatch_size=%d > algo.rollout_batch_size=%d: each update uses the whole rollout of %d",
                c.minibatch_size,
                c.rollout_batch_size,
                c.rollout_batch_size,
            )

    @classmethod
    def planned_models(cls, config: PPOConfig) -> list[tuple[str, str, str | None]]:
        critic = config.critic_path or config.reward_path or config.policy_path
        return super().planned_models(config) + [("critic", "trained", critic)]

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        if self.actor is not None:
            return
        from lit_rlhf.models.builders import build_causal_lm, resolve_path
        from lit_rlhf.models.reward import is_reward_model_dir, load_reward_model
        from lit_rlhf.models.value import ValueModel

        c: PPOConfig = self.config
        self.build_policy_and_reference()
        self.build_rewards()
        reward = self.frozen.get("reward")
        reward_is_causal = reward is not None and reward.kind == "causal_lm"
        # docs/algorithms.md §2.8: the critic starts from the reward model when it is a causal LM
        critic_path = c.critic_path or (c.reward_path if reward_is_causal else None)
        critic_path = resolve_path(critic_path) if critic_path else None
        if critic_path and is_reward_model_dir(critic_path):
            # a separate copy: the critic trains, the reward model stays frozen
            self.critic = ValueModel.from_reward_model(
                load_reward_model(
                    critic_path,
                    dtype=self.model_spec.dtype,
                    gradient_checkpointing=self.model_spec.gradient_checkpointing,
                )
            )
        else:
            spec = self.model_spec.at_path(critic_path) if critic_path else self.model_spec
            self.critic = ValueModel(build_causal_lm(spec, self.ensure_tokenizer()))
        self.with_lora(self.critic.backbone)  # its own adapters on its own trunk; the value head trains in full
        self.critic.padding_free = c.padding_free
        self.critic.train()

    # ------------------------------------------------------------ stage hooks
    def num_passes(self) -> int:
        return self.config.ppo_epochs

    def entropy_in_loss(self) -> bool:
        return bool(self.config.entropy_coef)

    # ---------------------------------------------------------------- 2. advantages
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Fill ``rewards``, ``advantages`` and ``returns`` (docs/algorithms.md §2.2–§2.5); returns
        the normalized score mean."""
        c: PPOConfig = self.config
        self.health.count_scores(rollout.scores)
        mask = rollout.valid_mask  # responses with a non-finite score are a counted skip: no token of theirs trains
        valid = torch.isfinite(rollout.scores)
        scores = torch.where(valid, rollout.scores, torch.zeros_like(rollout.scores))
        if c.missing_eos_penalty is not None:
            scores = penalize_missing_eos(scores, rollout.ended, c.missing_eos_penalty)
        scores = reparameterize_scores(scores, self.reward_moments, c.score_norm, c.score_clip, all_reduce_sum, valid)
        if rollout.ref_logprobs is not None:
            kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, c.kl_estimator, mask=mask)
        else:  # β = 0 and algo.monitor_kl=false: no reference, no KL
            kl = torch.zeros_like(rollout.logprobs)
        beta = self.kl_ctl.value if c.kl_placement == "reward" else 0.0
        rollout.rewards = shape_rewards(scores, kl, mask, beta)
        advantages, rollout.returns = gae(rollout.rewards, rollout.values, mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=all_reduce_sum)
        if c.advantage_clip is not None:
            advantages = advantages.clamp(-c.advantage_clip, c.advantage_clip)
        rollout.advantages = advantages
        return {"reward/normalized_mean": scores[valid].mean() if valid.any() else scores.new_tensor(0.0)}

    # -------------------------------------------------------------------- 3. update
    def ptx_term(self, ptx: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Token-mean LM loss of the actor on an SFT batch (PPO-ptx, docs/algorithms.md §2.6), over
        the tokens of all ranks' chunks with ``loss_normalization=global`` (:meth:`count_over_ranks`)."""
        logits = self.actor(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"]).logits
        tokens = self.count_over_ranks(ptx["response_mask"].sum().reshape(1))[0]
        return ptx_loss(shifted_token_logprobs(logits, ptx["input_ids"]), ptx["response_mask"], tokens)

    def minibatch_loss(
        self,
        mb: Rollout,
        fwd: PolicyForward,
        ptx: dict[str, Tensor] | None,
        counts: LossCounts | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Actor + critic loss of one minibatch or micro-batch (one backward covers both,
        docs/algorithms.md §2.6); the policy, entropy and value terms divide by ``counts`` (the whole
        minibatch's, over ranks: :meth:`RLModule.loss_counts`)."""
        c: PPOConfig = self.config
        mask = mb.valid_mask
        counts = counts or self.loss_counts(mask)
        actor_loss, stats = self.policy_loss(mb, fwd, counts)  # the surrogate (+ β·KL with kl_placement=loss)
        if c.entropy_coef:
            # the target form |mean H − target| cannot be split: it is each (micro-)batch's own
            tokens = counts.tokens if c.entropy_target is None else None
            ent_loss, _ = entropy_loss(fwd.entropy, mask, c.entropy_coef, c.entropy_target, tokens)
            actor_loss = actor_loss + ent_loss
        if ptx is not None and c.ptx_coef:
            ptx_l, ptx_stats = self.ptx_term(ptx)
            actor_loss = actor_loss + c.ptx_coef * ptx_l
            stats["ptx/loss"] = ptx_stats["loss"]
        if self.iteration < c.critic_warmup_steps:
            # critic warm-up: the actor stays in the graph with zero weight, so every parameter
            # gets a (zero) gradient and DDP needs no find_unused_parameters
            actor_loss = actor_loss * 0.0
        vf_loss, vf_stats = value_loss(fwd.values, mb.values, mb.returns, mask, c.value_clip, counts.tokens)
        stats.update({f"critic/{k}": v for k, v in vf_stats.items()})
        return actor_loss + c.vf_coef * vf_loss, stats

    # ------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        c: PPOConfig = self.config
        groups = self.decay_groups(self.actor, lr=c.lr) + self.decay_groups(self.critic, lr=c.critic_lr)
        optimizer = self.build_optimizer(groups)
        total = self.total_updates()
        # critic warm-up: the actor's lr is 0 for those updates (AdamW's weight decay would still
        # move it otherwise), then its own warm-up/decay schedule starts
        warm = c.critic_warmup_steps * self.updates_per_iteration()

        def actor_factor(step: int) -> float:
            return 0.0 if step < warm else self.lr_factor(step - warm, max(1, total - warm))

        def critic_factor(step: int) -> float:
            return self.lr_factor(step, total)

        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, [actor_factor, actor_factor, critic_factor, critic_factor])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -------------------------------------------------------------- state
    def rl_state_dict(self) -> dict[str, Any]:
        return {**super().rl_state_dict(), "reward_moments": self.reward_moments.state_dict()}

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        super().load_rl_state_dict(state)
        self.reward_moments.load_state_dict(state["reward_moments"])
