"""``PPOModule``: PPO / PPO-max for language models with manual optimization (ALGORITHMS §2–§3).

One RL iteration per ``training_step`` (DESIGN §3):

1. ``collect``: sample responses (KV cache), then one no-grad pass per model: actor log-probs,
   reference log-probs, critic values, reward score;
2. ``compute_advantages``: score reparameterization → per-token rewards (score on the EOS,
   −β·kl) → GAE → whitening (across ranks);
3. ``update``: ``ppo_epochs`` × shuffled minibatches; actor and critic losses summed and sent
   through ONE ``manual_backward`` and ONE optimizer with two parameter groups (own lr each):
   the arrangement that works under DDP without ``find_unused_parameters`` and under DeepSpeed,
   which accepts a single optimizer;
4. KL controller update; the step returns ``{"rollout", "stats"}`` for the monitor callbacks.

Models: the actor and the frozen reference load from ``policy_path`` (the SFT export); the
reward is a frozen reward model (``reward_path``) or a Python callable (``reward_fn``); the
critic is a value head on a causal trunk initialised from the reward model (or the policy).
Frozen models are kept OUT of the module tree (``self.frozen``): they are neither optimized nor
written into checkpoints, and reload from their paths.

``trainer.max_steps`` counts optimizer steps (Lightning's meaning): an iteration performs
``ppo_epochs × ceil(batch / minibatch_size)`` of them and training stops exactly at the limit.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.core.advantages import gae
from lit_rlhf.core.kl import AdaptiveKLController, FixedKLController, kl_penalty
from lit_rlhf.core.logprobs import shifted_token_logprobs
from lit_rlhf.core.losses import entropy_loss, ppo_policy_loss, ptx_loss, value_loss
from lit_rlhf.core.masked import masked_mean, masked_sum, masked_whiten
from lit_rlhf.core.rewards import penalize_missing_eos, reparameterize_scores, shape_rewards
from lit_rlhf.core.running_stats import RunningMoments
from lit_rlhf.core.types import Rollout
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.base import RLHFModule
from lit_rlhf.modules.configs import PPOConfig
from lit_rlhf.rollout.generate import sample
from lit_rlhf.rollout.minibatches import iterate_minibatches
from lit_rlhf.rollout.score import CallableScorer, ModelScorer, response_logprobs, response_values
from lit_rlhf.utils.distributed import all_reduce_sum

log = logging.getLogger(__name__)


def _has_dropout(module: nn.Module) -> bool:
    """Any active dropout (nn.Dropout p > 0, or a transformers config attention/hidden dropout)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        config = getattr(m, "config", None)
        if config is not None and any(getattr(config, k, 0) or 0 for k in ("attention_dropout", "hidden_dropout", "dropout")):
            return True
    return False


class PPOModule(RLHFModule):
    """PPO over (actor, critic) with a frozen reference and reward. ``data_kind = "prompt"``."""

    config_class = PPOConfig
    data_kind = "prompt"
    monitor = ("val/score_mean", "max")

    def __init__(self, config: PPOConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self.automatic_optimization = False
        c: PPOConfig = self.config
        self.actor: nn.Module | None = None
        self.critic: nn.Module | None = None
        self.frozen: dict[str, nn.Module] = {}  # plain dict: not submodules, not checkpointed
        self.scorer: Any = None
        self.gold_scorer: Any = None
        self.reward_moments = RunningMoments()
        self.kl_ctl = (
            AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon) if c.adaptive_kl else FixedKLController(c.kl_coef)
        )
        self.iteration = 0  # RL iterations completed (checkpointed)

    # ------------------------------------------------------------------ models
    @classmethod
    def resolve_model_spec(cls, config: PPOConfig, spec: ModelSpec) -> ModelSpec:
        """The policy to train is ``algo.policy_path``; ``model=…`` contributes dtype and memory switches."""
        return ModelSpec(
            name_or_path=config.policy_path,
            dtype=spec.dtype,
            trust_remote_code=spec.trust_remote_code,
            gradient_checkpointing=spec.gradient_checkpointing,
            attn_implementation=spec.attn_implementation,
        )

    def configure_model(self) -> None:
        if self.actor is not None:
            return
        from lit_rlhf.models.builders import build_causal_lm, build_tokenizer, freeze, resolve_path
        from lit_rlhf.models.reward import is_reward_model_dir, load_reward_model
        from lit_rlhf.models.value import ValueModel

        c: PPOConfig = self.config
        tok = self.ensure_tokenizer()
        self.actor = build_causal_lm(self.model_spec, tok).train()
        self.frozen["reference"] = freeze(build_causal_lm(self.model_spec, tok))
        reward_is_causal = False
        if c.reward_path is not None:
            path = resolve_path(c.reward_path)
            rm = freeze(load_reward_model(path, dtype=self.model_spec.dtype))
            reward_is_causal = rm.kind == "causal_lm"
            self.frozen["reward"] = rm
            rm_tok = build_tokenizer(ModelSpec(name_or_path=path, kind=rm.kind))
            self.scorer = ModelScorer(rm, rm_tok, tok, None, c.reward_max_length)
        else:
            from hydra.utils import instantiate

            self.scorer = CallableScorer(instantiate(c.reward_fn))
        if c.gold_reward_fn is not None:
            from hydra.utils import instantiate

            self.gold_scorer = CallableScorer(instantiate(c.gold_reward_fn))
        critic_path = c.critic_path or (c.reward_path if reward_is_causal else c.policy_path)
        critic_path = resolve_path(critic_path)
        if is_reward_model_dir(critic_path):
            # a separate copy: the critic trains, the reward model stays frozen
            self.critic = ValueModel.from_reward_model(load_reward_model(critic_path, dtype=self.model_spec.dtype))
        else:
            self.critic = ValueModel(build_causal_lm(self.model_spec.at_path(critic_path), tok))
        self.critic.train()

    def exportable_model(self) -> nn.Module:
        return self.actor

    def on_fit_start(self) -> None:
        for m in self.frozen.values():
            m.to(self.device)
        if isinstance(self.scorer, ModelScorer) and self.scorer.template is None:
            from lit_rlhf.data.templates import get_template

            dm = self.trainer.datamodule
            self.scorer.template = get_template(getattr(getattr(dm, "config", None), "template", "plain"))
        ptx_source = getattr(getattr(self._trainer.datamodule, "config", None), "ptx_source", None)
        if ptx_source and not self.config.ptx_coef:
            log.warning("data.prompt.ptx_source=%s is set but algo.ptx_coef=0: its batches are loaded and "
                        "never used (set algo.ptx_coef > 0, or drop the source)", ptx_source)  # fmt: skip

    # --------------------------------------------------------------- phase 1
    def decode_responses(self, response_ids: Tensor, response_mask: Tensor, ended: Tensor) -> list[str]:
        """Response texts without the final EOS. Other special tokens stay visible (a policy
        that emits <bos> mid-text must not be scored as fluent text)."""
        out = []
        for ids, n, e in zip(response_ids.tolist(), response_mask.sum(-1).tolist(), ended.tolist()):
            out.append(self.tokenizer.decode(ids[: n - 1 if e else n], skip_special_tokens=False).strip())
        return out

    def rollout_grad_mode(self) -> Any:
        """``torch.inference_mode()`` for generation and the frozen models' forwards (no autograd
        bookkeeping at all: ~5% faster decoding on CPU than ``no_grad``), except where parameters
        are sharded and gathered inside forwards (DeepSpeed ZeRO-3, FSDP, other strategies):
        there, ``no_grad``."""
        if self._trainer is None:
            return torch.inference_mode()
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            stage = (strategy.config or {}).get("zero_optimization", {}).get("stage", 0)
            return torch.no_grad() if stage >= 3 else torch.inference_mode()
        if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            return torch.inference_mode()
        return torch.no_grad()

    def collect(self, batch: dict[str, Any], score_policy: bool = True) -> Rollout:
        """Generate and score one batch of prompts (ALGORITHMS §2 "Rollout"), without grad.

        ``score_policy=False`` skips the actor and critic passes: the caller fills
        ``logprobs``/``values`` from the first training forward (see :meth:`fused_first_forward`).
        """
        with self.rollout_grad_mode():
            rollout = self._collect(batch, score_policy)
        return rollout.normal_tensors()

    def _collect(self, batch: dict[str, Any], score_policy: bool) -> Rollout:
        c: PPOConfig = self.config
        tok = self.tokenizer
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        response_ids, response_mask, ended = sample(
            self.actor, prompt_ids, prompt_mask, c.generation, tok.eos_token_id, tok.pad_token_id
        )
        ids = torch.cat([prompt_ids, response_ids], 1)
        mask = torch.cat([prompt_mask, response_mask], 1)
        width = prompt_ids.shape[1]
        temperature = c.generation.temperature if c.logprobs_at_sampling_temperature else 1.0
        logprobs = values = None
        if score_policy:
            self.actor.eval()
            logprobs, _ = response_logprobs(self.actor, ids, mask, width, temperature)
            self.actor.train()
            self.critic.eval()
            values = response_values(self.critic, ids, mask, width)
            self.critic.train()
        ref_logprobs, _ = response_logprobs(self.frozen["reference"], ids, mask, width, temperature)
        texts = self.decode_responses(response_ids, response_mask, ended)
        scores = self.scorer(ids, mask, batch["prompts"], texts, ended)
        return Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            ended=ended, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
            prompts_text=list(batch["prompts"]), responses_text=texts,
        )  # fmt: skip

    # --------------------------------------------------------------- phase 2
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Fill ``rewards``, ``advantages`` and ``returns``; returns reward-side stats."""
        c: PPOConfig = self.config
        mask = rollout.response_mask
        scores = rollout.scores
        if c.missing_eos_penalty is not None:
            scores = penalize_missing_eos(scores, rollout.ended, c.missing_eos_penalty)
        scores = reparameterize_scores(scores, self.reward_moments, c.score_norm, c.score_clip, all_reduce_sum)
        kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, c.kl_estimator)
        beta = self.kl_ctl.value if c.kl_placement == "reward" else 0.0
        rollout.rewards = shape_rewards(scores, kl, mask, beta)
        advantages, rollout.returns = gae(rollout.rewards, rollout.values, mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=all_reduce_sum)
        if c.advantage_clip is not None:
            advantages = advantages.clamp(-c.advantage_clip, c.advantage_clip)
        rollout.advantages = advantages
        # the KL controller's input over ALL ranks' rollouts (so β stays the same on every rank)
        kl_seq = masked_sum(kl, mask, dim=1)
        kl_sum_n = all_reduce_sum(torch.stack([kl_seq.sum(), kl.new_tensor(float(kl.shape[0]))]).float())
        return {"normalized_mean": scores.mean(), "kl_seq_global": kl_sum_n[0] / kl_sum_n[1], "n_global": kl_sum_n[1]}

    # --------------------------------------------------------------- phase 3
    def updates_per_iteration(self, batch_size: int) -> int:
        return self.config.ppo_epochs * math.ceil(batch_size / self.config.minibatch_size)

    def _max_steps_reached(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps >= 0 and self.global_step >= max_steps

    def ptx_term(self, ptx: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Token-mean LM loss of the actor on an SFT batch (PPO-ptx)."""
        logits = self.actor(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"]).logits
        return ptx_loss(shifted_token_logprobs(logits, ptx["input_ids"]), ptx["response_mask"])

    def forward_train(self, mb: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """With grad: (B, R) actor log-probs, (B, R) entropies, (B, R) critic values."""
        c: PPOConfig = self.config
        ids, mask, width = mb.input_ids, mb.attention_mask, mb.prompt_ids.shape[1]
        temperature = c.generation.temperature if c.logprobs_at_sampling_temperature else 1.0
        # the entropy needs a graph only when it is in the loss; otherwise it is a statistic
        logprobs, entropy = response_logprobs(
            self.actor, ids, mask, width, temperature, with_entropy=True, entropy_grad=bool(c.entropy_coef)
        )
        return logprobs, entropy, response_values(self.critic, ids, mask, width)

    def fused_first_forward(self, batch_size: int) -> bool:
        """Whether the rollout-time actor/critic passes can be the first training forward.

        With one PPO epoch over one minibatch, the weights the update starts from ARE the rollout
        weights, so log π_old and V_old equal that forward's outputs (detached) — exactly, as long
        as no dropout makes train-mode and eval-mode forwards differ. TRL computes them twice.
        """
        c: PPOConfig = self.config
        one_update = c.ppo_epochs == 1 and c.minibatch_size >= batch_size
        return c.fuse_first_forward and one_update and not (_has_dropout(self.actor) or _has_dropout(self.critic))

    def minibatch_loss(
        self, mb: Rollout, critic_only: bool, ptx: dict[str, Tensor] | None,
        forwards: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
        """Actor + critic loss of one minibatch (one backward covers both); ``forwards`` = the
        minibatch's :meth:`forward_train` outputs when already computed."""
        c: PPOConfig = self.config
        logprobs, entropy, values = forwards if forwards is not None else self.forward_train(mb)
        pg_loss, pg_stats = ppo_policy_loss(
            logprobs, mb.logprobs, mb.advantages, mb.response_mask, c.clip_eps_low, c.clip_eps_high, c.dual_clip
        )
        actor_loss = pg_loss
        stats = {f"policy/{k}": v for k, v in pg_stats.items()}
        ent_loss, ent_stats = entropy_loss(entropy, mb.response_mask, c.entropy_coef, c.entropy_target)
        stats["policy/entropy"] = ent_stats["entropy"]
        if c.entropy_coef:
            actor_loss = actor_loss + ent_loss
        if c.kl_placement == "loss" and self.kl_ctl.value:
            kl = masked_mean(kl_penalty(logprobs, mb.ref_logprobs, c.kl_estimator), mb.response_mask)
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
        vf_loss, vf_stats = value_loss(values, mb.values, mb.returns, mb.response_mask, c.value_clip)
        stats.update({f"critic/{k}": v for k, v in vf_stats.items()})
        return actor_loss + c.vf_coef * vf_loss, stats

    def update(
        self, rollout: Rollout, ptx: dict[str, Tensor] | None, forwards: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """``ppo_epochs`` × minibatches of one backward + one optimizer step each (``forwards``:
        the whole rollout's first training forward, fused path only)."""
        c: PPOConfig = self.config
        opt = self.optimizers()
        sched = self.lr_schedulers()
        critic_only = self.iteration < c.critic_warmup_steps
        n = rollout.scores.shape[0]
        gen = torch.Generator().manual_seed(int(self.trainer.current_epoch * 1_000_003 + self.iteration))
        minibatches = list(iterate_minibatches(n, c.minibatch_size, c.ppo_epochs, gen))
        if forwards is not None:  # fused: the single minibatch is the whole rollout, in order
            minibatches = [torch.arange(n)]
        ptx_chunks = None
        if ptx is not None and c.ptx_coef:
            rows = torch.arange(ptx["input_ids"].shape[0]).chunk(len(minibatches))
            ptx_chunks = [{k: v[r] for k, v in ptx.items()} for r in rows]
        collected: dict[str, list[Tensor]] = {}
        from lightning.pytorch.strategies import DeepSpeedStrategy

        clip_here = c.max_grad_norm is not None and not isinstance(self.trainer.strategy, DeepSpeedStrategy)
        for i, idx in enumerate(minibatches):
            if self._max_steps_reached():
                break
            chunk = ptx_chunks[i % len(ptx_chunks)] if ptx_chunks else None
            mb = rollout if forwards is not None else rollout.select(idx.to(rollout.scores.device))
            loss, stats = self.minibatch_loss(mb, critic_only, chunk, forwards)
            opt.zero_grad()
            self.manual_backward(loss)
            if clip_here:
                self.clip_gradients(opt, gradient_clip_val=c.max_grad_norm, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.detach().float())
        out = {k: torch.stack(v).mean() for k, v in collected.items()}
        if "policy/ratio_max" in collected:
            out["policy/ratio_max"] = torch.stack(collected["policy/ratio_max"]).max()
        return out

    # --------------------------------------------------------------- the step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        prompts, ptx = (batch["prompts"], batch["ptx"]) if "ptx" in batch else (batch, None)
        t0 = time.perf_counter()
        fused = self.fused_first_forward(prompts["prompt_ids"].shape[0])
        rollout = self.collect(prompts, score_policy=not fused)
        forwards = None
        if fused:
            forwards = self.forward_train(rollout)
            rollout.logprobs, rollout.values = forwards[0].detach(), forwards[2].detach()
        t1 = time.perf_counter()
        reward_stats = self.compute_advantages(rollout)
        stats = self.update(rollout, ptx, forwards)
        t2 = time.perf_counter()
        n = rollout.scores.shape[0]
        self.kl_ctl.update(float(reward_stats["kl_seq_global"]), int(reward_stats["n_global"]))
        self.iteration += 1
        # raw score statistics, KL, perplexity and length are the monitors' (callbacks/monitors.py)
        stats.update({
            "reward/normalized_mean": reward_stats["normalized_mean"],
            "kl_ctl/beta": torch.tensor(self.kl_ctl.value),
            "perf/rollout_s": torch.tensor(t1 - t0),
            "perf/train_s": torch.tensor(t2 - t1),
            "perf/samples_per_s": torch.tensor(n / max(t2 - t0, 1e-9)),
            # generated response tokens (EOS included) per second of the whole iteration
            "perf/tokens_per_s": rollout.response_mask.sum().float().cpu() / max(t2 - t0, 1e-9),
            "rl/iteration": torch.tensor(float(self.iteration)),
        })  # fmt: skip
        self.log_dict({k: v.float() for k, v in stats.items() if k != "rl/iteration"}, batch_size=n)
        self.log("rl/iteration", stats["rl/iteration"], prog_bar=True, batch_size=n)
        return {"rollout": rollout, "stats": stats}

    # ------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rollout = self.collect(batch)
        kl = masked_sum(rollout.logprobs - rollout.ref_logprobs, rollout.response_mask, dim=1)
        n = rollout.scores.shape[0]
        self.log("val/score_mean", rollout.scores.mean(), batch_size=n, sync_dist=True, prog_bar=True)
        self.log("val/kl", kl.mean(), batch_size=n, sync_dist=True)
        self.log("val/response_length", rollout.response_lengths.float().mean(), batch_size=n, sync_dist=True)
        if self.gold_scorer is not None:
            gold = self.gold_scorer(rollout.input_ids, rollout.attention_mask, rollout.prompts_text,
                                    rollout.responses_text, rollout.ended)  # fmt: skip
            self.log("val/gold_score_mean", gold.mean(), batch_size=n, sync_dist=True)

    # ------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        c: PPOConfig = self.config
        groups = []
        for module, lr in ((self.actor, c.lr), (self.critic, c.critic_lr)):
            params = [p for p in module.parameters() if p.requires_grad]
            groups.append({"params": [p for p in params if p.ndim >= 2], "lr": lr, "weight_decay": c.weight_decay})
            groups.append({"params": [p for p in params if p.ndim < 2], "lr": lr, "weight_decay": 0.0})
        optimizer = self.build_optimizer(groups)
        total = self.total_updates()
        # critic warm-up: the actor's lr is 0 for those updates (AdamW's weight decay would still
        # move it otherwise), then its own warm-up/decay schedule starts
        warm = c.critic_warmup_steps * self.updates_per_iteration(self._rollout_batch_size())

        def actor_factor(step: int) -> float:
            return 0.0 if step < warm else self.lr_factor(step - warm, max(1, total - warm))

        def critic_factor(step: int) -> float:
            return self.lr_factor(step, total)

        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, [actor_factor, actor_factor, critic_factor, critic_factor])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _rollout_batch_size(self) -> int:
        dm = self.trainer.datamodule if self._trainer is not None else None
        return dm.config.batch_size if dm is not None else self.config.minibatch_size

    def total_updates(self) -> int:
        """Optimizer steps of the whole fit: trainer.max_steps, else batches × updates per batch."""
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        batches = self.trainer.estimated_stepping_batches  # manual optimization: counts batches
        if not math.isfinite(batches):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the lr schedule needs a length")
        return max(1, int(batches) * self.updates_per_iteration(self._rollout_batch_size()))

    # -------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lit_rlhf_ppo"] = {
            "reward_moments": self.reward_moments.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "iteration": self.iteration,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lit_rlhf_ppo")
        if state is None:
            raise KeyError("not a PPO checkpoint: no 'lit_rlhf_ppo' state (reward moments, KL controller)")
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.iteration = int(state["iteration"])

    def on_fit_end(self) -> None:
        if self.config.export_dir:
            self.export(self.config.export_dir)
