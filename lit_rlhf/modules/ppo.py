"""``PPOModule``: PPO / PPO-max for language models with manual optimization (docs/algorithms.md §2–§3).

One RL iteration per ``training_step`` (docs/architecture.md "One RL iteration"):

1. :meth:`collect`: sample responses (KV cache), then one no-grad pass per model: actor
   log-probs, reference log-probs, critic values, reward score;
2. :meth:`compute_advantages`: score reparameterization → per-token rewards (score on the EOS,
   −β·kl) → GAE → whitening (across ranks);
3. :meth:`update`: ``ppo_epochs`` × shuffled minibatches; actor and critic losses summed and sent
   through ONE ``manual_backward`` and ONE optimizer with two parameter groups (own lr each):
   the arrangement that works under DDP without ``find_unused_parameters`` and under DeepSpeed,
   which accepts a single optimizer;
4. the KL controller sees the KL of all ranks' rollouts.

Models: the actor and the frozen reference load from ``policy_path`` (the SFT export; default:
the ``model`` group's model); the reward is a frozen reward model (``reward_path``) or a Python
callable (``reward_fn``); the critic is a value head on a causal trunk initialised from the
reward model (or the policy). ``trainer.max_steps`` counts optimizer steps (Lightning's
meaning): an iteration performs ``ppo_epochs × ceil(batch / minibatch_size)`` of them and
training stops exactly at the limit.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.core.advantages import gae
from lit_rlhf.core.kl import AdaptiveKLController, FixedKLController, kl_penalty, sequence_kl
from lit_rlhf.core.logprobs import shifted_token_logprobs
from lit_rlhf.core.losses import entropy_loss, ppo_policy_loss, ptx_loss, value_loss
from lit_rlhf.core.masked import masked_mean, masked_whiten
from lit_rlhf.core.rewards import penalize_missing_eos, reparameterize_scores, shape_rewards
from lit_rlhf.core.running_stats import RunningMoments
from lit_rlhf.core.types import Rollout
from lit_rlhf.modules.configs import PPOConfig
from lit_rlhf.modules.rl import RLModule
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.rollout.minibatches import iterate_minibatches
from lit_rlhf.rollout.score import response_logprobs, response_values
from lit_rlhf.utils.distributed import all_reduce_sum

log = logging.getLogger(__name__)


@dataclass
class PolicyForward:
    """One training forward of actor and critic over a minibatch (with grad)."""

    logprobs: Tensor  # (B, R) log π_θ(y_t | x, y_<t)
    entropy: Tensor  # (B, R) H(π_θ(·|s_t)); in the graph only when the entropy is in the loss
    values: Tensor  # (B, R) V_θ(s_t)


def _has_dropout(module: nn.Module) -> bool:
    """Any active dropout (nn.Dropout p > 0, or a transformers config attention/hidden dropout)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        config = getattr(m, "config", None)
        if config is not None and any(getattr(config, k, 0) or 0 for k in ("attention_dropout", "hidden_dropout", "dropout")):
            return True
    return False


class PPOModule(RLModule):
    """PPO over (actor, critic) with a frozen reference and reward. ``data_kind = "prompt"``."""

    config_class = PPOConfig
    model_path_keys = ("policy_path", "reward_path", "critic_path")

    def __init__(self, config: PPOConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        c: PPOConfig = self.config
        self.critic: nn.Module | None = None
        self.reward_moments = RunningMoments()
        if c.adaptive_kl:
            self.kl_ctl = AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(c.kl_coef)
        self._first_forward: PolicyForward | None = None  # the fused path's, for update()
        if c.minibatch_size > c.rollout_batch_size:
            log.warning("algo.minibatch_size=%d > algo.rollout_batch_size=%d: each update uses the whole rollout of %d",
                        c.minibatch_size, c.rollout_batch_size, c.rollout_batch_size)  # fmt: skip

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
            self.critic = ValueModel.from_reward_model(load_reward_model(
                critic_path, dtype=self.model_spec.dtype, gradient_checkpointing=self.model_spec.gradient_checkpointing))
        else:
            spec = self.model_spec.at_path(critic_path) if critic_path else self.model_spec
            self.critic = ValueModel(build_causal_lm(spec, self.ensure_tokenizer()))
        self.with_lora(self.critic.backbone)  # its own adapters on its own trunk; the value head trains in full
        self.critic.padding_free = c.padding_free
        self.critic.train()

    def on_fit_start(self) -> None:
        super().on_fit_start()
        ptx_source = getattr(self.trainer.datamodule.config, "ptx_source", None) if self.trainer.datamodule else None
        if ptx_source and not self.config.ptx_coef:
            log.warning("data.prompt.ptx_source=%s is set but algo.ptx_coef=0: its batches are loaded and "
                        "never used (set algo.ptx_coef > 0, or drop the source)", ptx_source)  # fmt: skip

    # --------------------------------------------------------------- the step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        prompts, ptx = (batch["prompts"], batch["ptx"]) if "ptx" in batch else (batch, None)
        started = time.perf_counter()
        rollout = self.collect(prompts)
        collected = time.perf_counter()
        stats = self.compute_advantages(rollout)
        stats.update(self.update(rollout, ptx))
        self.kl_ctl.update(float(stats.pop("kl_seq_global")), int(stats.pop("n_global")))
        return self.end_iteration(rollout, stats, started, collected)

    # --------------------------------------------------------------- phase 1
    def collect(self, batch: dict[str, Any]) -> Rollout:
        """Generate and score one batch of prompts (docs/algorithms.md §2.1): a complete rollout.

        When the update is ONE minibatch of ONE epoch (:meth:`fused_first_forward`), the actor
        and critic are scored by the update's own first forward (with grad; kept for
        :meth:`update`) instead of separate no-grad passes: exact, and two forwards cheaper.
        """
        fused = self.fused_first_forward(batch["prompt_ids"].shape[0])
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor, batch, self.tokenizer, self.config.generation, reference=self.frozen["reference"],
                critic=None if fused else self.critic, scorer=self.scorer, policy_logprobs=not fused,
                logprob_temperature=self.logprob_temperature(), padding_free=self.config.padding_free,
            )  # fmt: skip
        rollout = rollout.normal_tensors()
        if fused:
            self._first_forward = self.policy_forward(rollout)
            rollout.logprobs = self._first_forward.logprobs.detach()
            rollout.values = self._first_forward.values.detach()
        return rollout.require("logprobs", "ref_logprobs", "values", "scores")

    def fused_first_forward(self, batch_size: int) -> bool:
        """Whether the rollout-time actor/critic passes can be the first training forward.

        With one PPO epoch over one minibatch, the weights the update starts from ARE the rollout
        weights, so log π_old and V_old equal that forward's outputs (detached) — exactly, as long
        as no dropout makes train-mode and eval-mode forwards differ.
        """
        c: PPOConfig = self.config
        one_update = c.ppo_epochs == 1 and c.minibatch_size >= batch_size
        return c.fuse_first_forward and one_update and not (_has_dropout(self.actor) or _has_dropout(self.critic))

    # --------------------------------------------------------------- phase 2
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Fill ``rewards``, ``advantages`` and ``returns`` (docs/algorithms.md §2.2–§2.5); returns
        the normalized score mean and the KL controller's input over ALL ranks' rollouts."""
        c: PPOConfig = self.config
        self.health.count_scores(rollout.scores)
        mask = rollout.valid_mask  # responses with a non-finite score are a counted skip: no token of theirs trains
        valid = torch.isfinite(rollout.scores)
        scores = torch.where(valid, rollout.scores, torch.zeros_like(rollout.scores))
        if c.missing_eos_penalty is not None:
            scores = penalize_missing_eos(scores, rollout.ended, c.missing_eos_penalty)
        scores = reparameterize_scores(scores, self.reward_moments, c.score_norm, c.score_clip, all_reduce_sum, valid)
        kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, c.kl_estimator)
        beta = self.kl_ctl.value if c.kl_placement == "reward" else 0.0
        rollout.rewards = shape_rewards(scores, kl, mask, beta)
        advantages, rollout.returns = gae(rollout.rewards, rollout.values, mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=all_reduce_sum)
        if c.advantage_clip is not None:
            advantages = advantages.clamp(-c.advantage_clip, c.advantage_clip)
        rollout.advantages = advantages
        # so that β stays the same on every rank
        kl_seq = sequence_kl(rollout.logprobs, rollout.ref_logprobs, mask, c.kl_estimator)
        kl_sum_n = all_reduce_sum(torch.stack([kl_seq.sum(), kl.new_tensor(float(kl.shape[0]))]).float())
        return {"reward/normalized_mean": scores[valid].mean() if valid.any() else scores.new_tensor(0.0),
                "kl_seq_global": kl_sum_n[0] / kl_sum_n[1], "n_global": kl_sum_n[1]}  # fmt: skip

    # --------------------------------------------------------------- phase 3
    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        batch_size = self.config.rollout_batch_size if batch_size is None else batch_size
        return self.config.ppo_epochs * math.ceil(batch_size / self.config.minibatch_size)

    def policy_forward(self, mb: Rollout) -> PolicyForward:
        """Actor log-probs and entropies and critic values of a minibatch, with grad."""
        c: PPOConfig = self.config
        ids, mask, width = mb.input_ids, mb.attention_mask, mb.prompt_ids.shape[1]
        # the entropy needs a graph only when it is in the loss; otherwise it is a statistic
        logprobs, entropy = response_logprobs(self.actor, ids, mask, width, self.logprob_temperature(),
                                              with_entropy=True, entropy_grad=bool(c.entropy_coef),
                                              padding_free=c.padding_free)  # fmt: skip
        return PolicyForward(logprobs, entropy, response_values(self.critic, ids, mask, width))

    def ptx_term(self, ptx: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Token-mean LM loss of the actor on an SFT batch (PPO-ptx, docs/algorithms.md §2.6)."""
        logits = self.actor(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"]).logits
        return ptx_loss(shifted_token_logprobs(logits, ptx["input_ids"]), ptx["response_mask"])

    def minibatch_loss(
        self, mb: Rollout, fwd: PolicyForward, critic_only: bool, ptx: dict[str, Tensor] | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Actor + critic loss of one minibatch (one backward covers both, docs/algorithms.md §2.6)."""
        c: PPOConfig = self.config
        mask = mb.valid_mask
        pg_loss, pg_stats = ppo_policy_loss(
            fwd.logprobs, mb.logprobs, mb.advantages, mask, c.clip_eps_low, c.clip_eps_high, c.dual_clip
        )
        actor_loss = pg_loss
        stats = {f"policy/{k}": v for k, v in pg_stats.items()}
        ent_loss, ent_stats = entropy_loss(fwd.entropy, mask, c.entropy_coef, c.entropy_target)
        stats["policy/entropy"] = ent_stats["entropy"]
        if c.entropy_coef:
            actor_loss = actor_loss + ent_loss
        if c.kl_placement == "loss" and self.kl_ctl.value:
            kl = masked_mean(kl_penalty(fwd.logprobs, mb.ref_logprobs, c.kl_estimator), mask)
            actor_loss = actor_loss + self.kl_ctl.value * kl
            stats["policy/kl_loss"] = kl.detach()
        if ptx is not None and c.ptx_coef:
            ptx_l, ptx_stats = self.ptx_term(ptx)
            actor_loss = actor_loss + c.ptx_coef * ptx_l
            stats["ptx/loss"] = ptx_stats["loss"]
        if critic_only:
            # critic warm-up: the actor stays in the graph with zero weight, so every parameter
            # gets a (zero) gradient and DDP needs no find_unused_parameters
            actor_loss = actor_loss * 0.0
        vf_loss, vf_stats = value_loss(fwd.values, mb.values, mb.returns, mask, c.value_clip)
        stats.update({f"critic/{k}": v for k, v in vf_stats.items()})
        return actor_loss + c.vf_coef * vf_loss, stats

    def update(self, rollout: Rollout, ptx: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """``ppo_epochs`` × minibatches of one backward + one optimizer step each."""
        c: PPOConfig = self.config
        opt, sched = self.optimizers(), self.lr_schedulers()
        first, self._first_forward = self._first_forward, None
        n = rollout.scores.shape[0]
        if first is not None:  # fused: the single minibatch is the whole rollout, in order
            minibatches = [torch.arange(n)]
        else:
            gen = torch.Generator().manual_seed(int(self.trainer.current_epoch * 1_000_003 + self.iteration))
            minibatches = list(iterate_minibatches(n, c.minibatch_size, c.ppo_epochs, gen))
        ptx_chunks = None
        if ptx is not None and c.ptx_coef:
            rows = torch.arange(ptx["input_ids"].shape[0]).chunk(len(minibatches))
            ptx_chunks = [{k: v[r] for k, v in ptx.items()} for r in rows]
        collected: dict[str, list[Tensor]] = {}
        for i, idx in enumerate(minibatches):
            if self.max_steps_reached():
                break
            mb = rollout if first is not None else rollout.select(idx.to(rollout.scores.device))
            chunk = ptx_chunks[i % len(ptx_chunks)] if ptx_chunks else None
            loss, stats = self.minibatch_loss(mb, first or self.policy_forward(mb), self.iteration < c.critic_warmup_steps,
                                              chunk)  # fmt: skip
            self.optimizer_step(opt, sched, loss)
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.detach().float())
        return self.mean_stats(collected)

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
