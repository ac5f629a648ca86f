"""``CriticFreeModule``: critic-free RL — GRPO, DAPO, Dr. GRPO, RLOO, REINFORCE++ (-baseline) and ReMax,
each a preset of this one module (docs/algorithms.md §6). ``GRPOModule`` is its former name, kept as an alias.

The RL iteration is :class:`~lit_rlhf.modules.rl.RLModule`'s; GRPO supplies what differs:

* G responses per prompt (``num_generations``; a group's rows are consecutive), and with DAPO's
  dynamic sampling (:meth:`refine_rollout`) groups whose rewards are all equal are dropped and
  more prompts are sampled until the batch is full (up to ``max_resample_rounds``); with ReMax's
  greedy baseline, :meth:`sample` also decodes one greedy response per prompt through the same
  rollout path and keeps only its score (``rollout.baseline_scores``: never trained on);
* :meth:`compute_advantages`: optional overlong shaping of the reward, a baseline (the group's
  mean or leave-one-out mean, optionally scaled by the group std; the greedy response's score;
  none), then the token advantages: with the KL in the loss, the sequence advantage on every
  response token; with the KL in the reward (REINFORCE++, ReMax), the return-to-go of −β·kl_t plus
  the score on the last token; optionally whitened over the whole rollout of all ranks. Responses
  with a non-finite reward are counted and left out;
* :meth:`minibatch_loss`: the clipped surrogate (ε_low, ε_high), + β·KL(π‖π_ref) when it is in the
  LOSS (k3), aggregated per sequence, per token, or over a constant (Dr. GRPO), β read from the
  controller.

No critic. With β = 0 the reference is still loaded to log the KL to the starting policy,
unless ``algo.monitor_kl=false``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.advantages import group_advantages, reinforce_advantages
from lit_rlhf.core.kl import kl_penalty
from lit_rlhf.core.shaping import overlong_penalty
from lit_rlhf.core.types import Rollout, cat_rollouts
from lit_rlhf.modules.configs import CriticFreeConfig
from lit_rlhf.modules.rl import LossCounts, PolicyForward, RLModule
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.utils.distributed import all_reduce_min, all_reduce_sum


class CriticFreeModule(RLModule):
    """Critic-free policy optimization of ``self.actor`` (GRPO and its family); ``data_kind = "prompt"``."""

    config_class = CriticFreeConfig

    def __init__(self, config: CriticFreeConfig | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any):
        super().__init__(config, model, tokenizer, **kwargs)
        self._extra_prompts: Any = None  # dynamic sampling's own prompt stream
        self.extra_batches = 0  # prompt batches drawn from it (checkpointed: a resume skips them)

    @classmethod
    def prompts_per_iteration(cls, config: CriticFreeConfig) -> int:
        return config.rollout_batch_size // config.num_generations

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        if self.actor is not None:
            return
        self.build_policy_and_reference()
        self.build_rewards()

    def configure_optimizers(self) -> Any:
        optimizer = self.build_optimizer(self.decay_groups(self.actor))
        return {"optimizer": optimizer, "lr_scheduler": self.build_scheduler(optimizer, self.total_updates())}

    # ------------------------------------------------------------ stage hooks
    def responses_per_prompt(self) -> int:
        return self.config.num_generations

    def num_passes(self) -> int:
        return self.config.num_iterations

    # ------------------------------------------------------------------- 1. collect
    def sample(self, batch: dict[str, Any], policy_logprobs: bool = True, drawn: Any = None) -> Rollout:
        """:meth:`RLModule.sample`; with ``advantage_baseline=greedy`` (ReMax) each row also gets the
        score of the greedy response to its prompt (``baseline_scores``), decoded first, so that the
        scorer's per-component rewards (``reward/<name>``) are the sampled responses'. Greedy
        decoding draws no random numbers: the sampled responses are those of a run without it."""
        if self.config.advantage_baseline != "greedy":
            return super().sample(batch, policy_logprobs, drawn)
        greedy = self.greedy_scores(batch)
        rollout = super().sample(batch, policy_logprobs, drawn)
        rollout.baseline_scores = greedy.repeat_interleave(self.responses_per_prompt())
        return rollout

    def greedy_scores(self, batch: dict[str, Any]) -> Tensor:
        """ReMax's baseline (Li et al. 2023, Algorithm 1): the reward of the greedy response to each
        prompt of ``batch``, sampled by the one rollout path (``generate_and_score``, the sampling
        settings with ``do_sample=false``; with an environment, a greedy multi-turn trajectory) and
        scored by the reward only."""
        gen = replace(self.config.generation, do_sample=False)
        with self.rollout_grad_mode():
            greedy = generate_and_score(
                self.actor,
                batch,
                self.tokenizer,
                gen,
                scorer=self.scorer,
                policy_logprobs=False,
                padding_free=self.config.padding_free,
                engine=self.rollout_engine(self.actor),
                agent=self.agent_loop(),
            )
        return greedy.scores.clone()  # a normal tensor (not an inference-mode one)

    def refine_rollout(self, rollout: Rollout, batch: dict[str, Any], fused: bool) -> tuple[Rollout, dict[str, Tensor]]:
        """DAPO's dynamic sampling when ``algo.dynamic_sampling``; else the rollout as sampled."""
        if not self.config.dynamic_sampling:
            return rollout, {}
        return self.dynamic_sampling(rollout, batch["prompt_ids"].shape[0], fused)

    def dynamic_sampling(self, rollout: Rollout, groups_wanted: int, fused: bool) -> tuple[Rollout, dict[str, Tensor]]:
        """DAPO: keep the groups whose rewards differ; sample more prompts (their own stream) until
        ``groups_wanted`` groups are kept or ``max_resample_rounds`` extra batches were drawn.
        Under several processes every rank samples again while any rank is short (sampling is
        collective), and all ranks train on the fewest groups any rank kept."""
        c: CriticFreeConfig = self.config
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
            if (
                not bool(all_reduce_sum(torch.tensor(float(short), device=rollout.scores.device)))
                or rounds >= c.max_resample_rounds
            ):
                break
            rounds += 1
            rollout = self.sample(self.next_extra_prompts(), policy_logprobs=not fused)
        if not kept:  # no group had a signal: train on the last batch (zero advantages: only the KL acts)
            kept = [rollout]
        out = cat_rollouts(kept, self.tokenizer.pad_token_id)
        # every rank trains on as many groups (the fewest any rank has): the update's minibatch
        # count, hence its collectives (gradient all-reduces), must agree
        n = torch.tensor(min(out.scores.shape[0], groups_wanted * g), device=out.scores.device)
        out = out.select(torch.arange(int(all_reduce_min(n))))
        n_groups = out.scores.shape[0] // g
        return out, {
            "grpo/dropped_groups": torch.tensor(float(dropped)),
            "grpo/resample_rounds": torch.tensor(float(rounds)),
            "grpo/kept_groups": torch.tensor(float(n_groups)),
        }

    def next_extra_prompts(self) -> dict[str, Any]:
        if self._extra_prompts is None:
            loader = self.trainer.datamodule.extra_dataloader()
            self._extra_prompts = _cycle(loader, skip=self.extra_batches)
        self.extra_batches += 1
        batch = next(self._extra_prompts)
        return self.trainer.strategy.batch_to_device(batch)

    # ---------------------------------------------------------------- 2. advantages
    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Overlong shaping, the baseline, then the token advantages (docs/algorithms.md §6): the
        sequence advantage on every token (KL in the loss), or the return-to-go of the KL-shaped
        reward (KL in the reward: REINFORCE++, ReMax, β from the controller); whitened over all
        ranks with ``whiten_advantages``. Fills ``rollout.advantages`` and ``rollout.rewards``."""
        c: CriticFreeConfig = self.config
        self.health.count_scores(rollout.scores)
        valid = torch.isfinite(rollout.scores)
        rewards = rollout.scores
        if c.overlong_buffer is not None:
            max_length = c.overlong_max_length or c.generation.max_new_tokens
            rewards = rewards + overlong_penalty(rollout.response_lengths, max_length, c.overlong_buffer)
        stats = {"reward/shaped_mean": rewards[valid].mean() if valid.any() else rewards.new_tensor(0.0)}
        if c.advantage_baseline in ("mean", "leave_one_out"):
            adv, no_signal = group_advantages(
                rewards, c.num_generations, c.scale_rewards, c.advantage_baseline, 1e-4, valid
            )
            stats["grpo/zero_std_groups"] = no_signal.float().mean()
        else:  # greedy (ReMax) or none (REINFORCE++): r − b per response
            greedy = c.advantage_baseline == "greedy"
            base = rollout.require("baseline_scores").baseline_scores if greedy else torch.zeros_like(rewards)
            # a non-finite greedy score gives its rows no score signal (r − b := 0); the KL term still acts
            base_ok = torch.isfinite(base)
            adv = torch.where(valid & base_ok, rewards - torch.where(base_ok, base, rewards), torch.zeros_like(rewards))
            if greedy:
                stats["reward/greedy_mean"] = base[base_ok].mean() if base_ok.any() else base.new_tensor(0.0)
        mask = rollout.valid_mask  # responses without a finite reward are left out
        beta = self.kl_ctl.value if c.kl_placement == "reward" and rollout.ref_logprobs is not None else 0.0
        if beta:
            kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, c.kl_estimator, mask=mask)
        else:  # the KL is in the loss, β = 0, or no reference (β = 0 and algo.monitor_kl=false)
            kl = torch.zeros_like(rollout.response_mask, dtype=adv.dtype)
        rollout.advantages, rollout.rewards = reinforce_advantages(
            adv, kl, mask, beta, whiten=c.whiten_advantages, all_reduce=all_reduce_sum
        )
        return stats

    # -------------------------------------------------------------------- 3. update
    def minibatch_loss(
        self,
        mb: Rollout,
        fwd: PolicyForward,
        ptx: dict[str, Tensor] | None = None,
        counts: LossCounts | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The shared policy loss alone (:meth:`RLModule.policy_loss`: the surrogate, + β·KL when
        ``kl_placement=loss``, with the configured aggregation and ``counts``); ``ptx``: unused."""
        return self.policy_loss(mb, fwd, counts)

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


GRPOModule = CriticFreeModule
"""The former name of :class:`CriticFreeModule`."""
