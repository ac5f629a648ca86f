"""``RLModule``: what every RL stage shares, and the public interface callbacks use.

An RL stage (PPO now, GRPO next) runs one RL iteration per ``training_step`` under manual
optimization: collect a scored rollout from a batch of prompts (lit_rlhf/rollout/collect.py),
compute advantages, update, and return ``{"rollout", "stats"}`` for the monitor callbacks
(docs/architecture.md "One RL iteration"). This base class holds the rest: the frozen
reference and reward models, validation rollouts, the iteration counter, the KL coefficient,
the RL state kept in checkpoints, and the export of the policy.

Callbacks (the collapse alarm, the monitors, the progress bar) talk to an RL stage only
through this interface, never through private attributes:

* :attr:`rl_iteration` — RL iterations completed (the x-axis of every RL panel);
* :attr:`kl_coef`, :meth:`scale_kl_coef` — read / raise β;
* :meth:`rl_state_dict`, :meth:`load_rl_state_dict` — the non-parameter state a snapshot or a
  checkpoint must hold (iteration, KL controller, and whatever a subclass adds);
* :meth:`updates_per_iteration` — optimizer steps one iteration performs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.core.kl import FixedKLController, sequence_kl
from lit_rlhf.core.types import Rollout
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.base import RLHFModule, policy_spec
from lit_rlhf.modules.configs import RLConfig
from lit_rlhf.modules.health import TrainingHealth, all_ranks_finite
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.distributed import all_reduce_max, all_reduce_sum

log = logging.getLogger(__name__)


class RLModule(RLHFModule):
    """Base of the RL stages: policy ``self.actor``, frozen models in ``self.frozen`` (a plain
    dict: neither optimized nor checkpointed; they reload from their paths)."""

    config_class = RLConfig
    data_kind = "prompt"
    monitor = ("val/score_mean", "max")
    model_path_keys = ("policy_path", "reward_path")
    checkpoint_key = "lit_rlhf_rl"

    def __init__(self, config: Any = None, model: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__(config, model, tokenizer, **kwargs)
        self.automatic_optimization = False
        self.actor: nn.Module | None = None
        self.frozen: dict[str, nn.Module] = {}
        self.scorer: Any = None
        self.gold_scorer: Any = None
        self.kl_ctl = FixedKLController(self.config.kl_coef)
        self.iteration = 0
        self.health = TrainingHealth(self.config.max_bad_iterations, "the reward")

    # ------------------------------------------------------- public interface
    @property
    def rl_iteration(self) -> int:
        """RL iterations completed (checkpointed)."""
        return self.iteration

    @property
    def kl_coef(self) -> float:
        """The current β."""
        return self.kl_ctl.value

    def scale_kl_coef(self, factor: float, floor: float = 1e-3) -> tuple[float, float]:
        """β ← max(β, floor) · factor (β = 0 could not be raised by a factor); returns (old, new)."""
        old = self.kl_ctl.value
        self.kl_ctl.value = max(old, floor) * factor
        return old, self.kl_ctl.value

    def rl_state_dict(self) -> dict[str, Any]:
        """Non-parameter training state; subclasses add theirs (e.g. PPO's running reward moments)."""
        return {"iteration": self.iteration, "kl_ctl": self.kl_ctl.state_dict(), "health": self.health.state_dict()}

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.health.load_state_dict(state.get("health", {}))

    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        """Optimizer steps of one RL iteration (1 unless a subclass does more)."""
        return 1

    # ------------------------------------------------------------ runner hooks
    @classmethod
    def resolve_model_spec(cls, config: RLConfig, spec: ModelSpec) -> ModelSpec:
        """The policy is ``algo.policy_path`` when set, else the ``model`` group's model; ``model=…``
        always contributes dtype and memory switches."""
        return policy_spec(config.policy_path, spec)

    @classmethod
    def prompts_per_iteration(cls, config: RLConfig) -> int:
        """Prompts one iteration samples (the prompt loader's batch): one response each by default."""
        return config.rollout_batch_size

    @classmethod
    def resolve_data_config(cls, config: RLConfig, data: Any) -> Any:
        """The prompt loader's batch follows ``algo.rollout_batch_size`` (one value, one key)."""
        prompts = cls.prompts_per_iteration(config)
        if data.batch_size is None:
            return replace(data, batch_size=prompts)
        if data.batch_size != prompts:
            raise ConfigError(
                "data.prompt.batch_size",
                f"the rollout batch of an RL stage is algo.rollout_batch_size ({config.rollout_batch_size} responses, "
                f"{prompts} prompts); remove data.prompt.batch_size={data.batch_size} or set algo.rollout_batch_size",
            )
        return data

    # ------------------------------------------------------------------ models
    def build_policy_and_reference(self) -> None:
        """``self.actor`` (trainable) and ``self.frozen["reference"]`` from the same weights."""
        from lit_rlhf.models.builders import build_causal_lm, freeze

        tok = self.ensure_tokenizer()
        self.actor = self.with_lora(build_causal_lm(self.model_spec, tok)).train()
        self.frozen["reference"] = self.reference_for(self.actor, lambda: freeze(build_causal_lm(self.model_spec, tok)))

    def build_rewards(self) -> None:
        """``self.scorer`` from ``reward_path`` (a frozen reward model) or ``reward_fn``, and the
        validation-only ``self.gold_scorer``."""
        from hydra.utils import instantiate

        from lit_rlhf.models.builders import build_tokenizer, freeze, resolve_path
        from lit_rlhf.models.reward import load_reward_model
        from lit_rlhf.rollout.score import CallableScorer, ModelScorer, WeightedScorer

        c: RLConfig = self.config
        self.health.reward_name = (f"the reward model {c.reward_path}" if c.reward_path else f"reward_fn "
                                   f"{c.reward_fn['_target_']}" if c.reward_fn else "reward_fns")  # fmt: skip
        if c.reward_path is not None:
            path = resolve_path(c.reward_path)
            rm = freeze(load_reward_model(path, dtype=self.model_spec.dtype))
            rm.padding_free = c.padding_free
            self.frozen["reward"] = rm
            rm_tok = build_tokenizer(ModelSpec(name_or_path=path, kind=rm.kind))
            self.scorer = ModelScorer(rm, rm_tok, self.ensure_tokenizer(), None, c.reward_max_length)
        elif c.reward_fn is not None:
            self.scorer = CallableScorer(instantiate(c.reward_fn), c.reward_fn["_target_"])
        else:
            parts = []
            for spec in c.reward_fns:
                spec = dict(spec)
                weight, name = float(spec.pop("weight", 1.0)), spec.pop("name", None)
                name = name or spec["_target_"].rsplit(".", 1)[-1]
                parts.append((name, weight, CallableScorer(instantiate(spec), spec["_target_"])))
            self.scorer = WeightedScorer(parts)
        if c.gold_reward_fn is not None:
            self.gold_scorer = CallableScorer(instantiate(c.gold_reward_fn), c.gold_reward_fn["_target_"])

    def exportable_model(self) -> nn.Module:
        return self.actor

    def on_fit_start(self) -> None:
        from lit_rlhf.data.prompts import PromptDataModule

        dm = self.trainer.datamodule
        prompts = self.prompts_per_iteration(self.config)
        if isinstance(dm, PromptDataModule) and dm.config.batch_size != prompts:
            # the step budget, the lr schedule and the progress bar count with rollout_batch_size
            raise ValueError(f"the prompt loader's batch ({dm.config.batch_size}) is not the {prompts} prompts of "
                             f"algo.rollout_batch_size={self.config.rollout_batch_size}: build the data module with "
                             "that batch size")  # fmt: skip
        for m in self.frozen.values():
            m.to(self.device)
        self._set_scorer_template()

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # trainer.validate() before fit: no on_fit_start
            self.on_fit_start()

    def _set_scorer_template(self) -> None:
        from lit_rlhf.data.templates import get_template
        from lit_rlhf.rollout.score import ModelScorer

        if isinstance(self.scorer, ModelScorer) and self.scorer.template is None:
            dm = self.trainer.datamodule
            self.scorer.template = get_template(dm.config.template if dm is not None else "plain")

    # ------------------------------------------------------------------ rollout
    def rollout_grad_mode(self) -> Any:
        """The rollout's context (generation and scoring): :meth:`RLHFModule.sampling_mode` (under
        ZeRO-3 and FSDP it gathers every trained model, the critic too, for the whole rollout)."""
        return self.sampling_mode(self.actor)

    def logprob_temperature(self) -> float:
        c: RLConfig = self.config
        return c.generation.temperature if c.logprobs_at_sampling_temperature else 1.0

    def evaluation_rollout(self, batch: dict[str, Any]) -> Rollout:
        """One sampled response per prompt, scored by the policy, the reference and the reward."""
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor, batch, self.tokenizer, self.config.generation, reference=self.frozen.get("reference"),
                scorer=self.scorer, logprob_temperature=self.logprob_temperature(),
                padding_free=self.config.padding_free,
            )  # fmt: skip
        return rollout.normal_tensors()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rollout = self.evaluation_rollout(batch)
        n = rollout.scores.shape[0]
        self.log("val/score_mean", rollout.scores.mean(), batch_size=n, sync_dist=True, prog_bar=True)
        if rollout.ref_logprobs is not None:
            kl = sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.response_mask, clamp=None)
            self.log("val/kl", kl.mean(), batch_size=n, sync_dist=True)
        self.log("val/response_length", rollout.response_lengths.float().mean(), batch_size=n, sync_dist=True)
        if self.gold_scorer is not None:
            gold = self.gold_scorer(rollout.input_ids, rollout.attention_mask, rollout.prompts_text,
                                    rollout.responses_text, rollout.ended)  # fmt: skip
            self.log("val/gold_score_mean", gold.mean(), batch_size=n, sync_dist=True)

    # ------------------------------------------------------------ iterations
    def max_steps_reached(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps >= 0 and self.global_step >= max_steps

    def optimizer_step(self, opt: Any, sched: Any, loss: Tensor) -> bool:
        """zero_grad → backward → global grad-norm clip (DeepSpeed clips in its own config) → step.

        A loss that is not finite on some rank, or a non-finite gradient norm, is skipped and
        counted: no optimizer or schedule step (lit_rlhf/modules/health.py). The norm is computed
        once for the check and the clip, across shards under FSDP
        (:func:`lit_rlhf.utils.strategies.sharded_grad_norm`), so every rank decides alike. Under
        DeepSpeed the gradients live in the engine: only the loss is checked there. Returns
        whether the update was applied.
        """
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lit_rlhf.utils.strategies import sharded_grad_norm

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

    def total_updates(self) -> int:
        """Optimizer steps of the whole fit: trainer.max_steps, else batches × updates per batch."""
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        batches = self.trainer.estimated_stepping_batches  # manual optimization: counts batches
        if not math.isfinite(batches):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the lr schedule needs a length")
        return max(1, int(batches) * self.updates_per_iteration())

    def end_iteration(self, rollout: Rollout, stats: dict[str, Tensor], started: float, collected: float) -> dict[str, Any]:
        """Count the iteration, log its statistics and timings, and return the step output the
        monitor callbacks read (raw score statistics, KL, perplexity and length are theirs)."""
        self.iteration += 1
        now = time.perf_counter()
        n = rollout.response_mask.shape[0]
        stats = {
            **stats,
            "kl_ctl/beta": torch.tensor(self.kl_ctl.value),
            "perf/rollout_s": torch.tensor(collected - started),
            "perf/train_s": torch.tensor(now - collected),
            "perf/samples_per_s": torch.tensor(n / max(now - started, 1e-9)),
            # generated response tokens (EOS included) per second of the whole iteration
            "perf/tokens_per_s": rollout.response_mask.sum().float().cpu() / max(now - started, 1e-9),
            "rl/iteration": torch.tensor(float(self.iteration)),
            **self.health.end_iteration(),  # raises NonFiniteTrainingError after too many bad iterations
        }
        stats = self.stats_over_ranks(stats)
        self.log_dict({k: v.float() for k, v in stats.items() if k != "rl/iteration"}, batch_size=n)
        self.log("rl/iteration", stats["rl/iteration"], prog_bar=True, batch_size=n)
        return {"rollout": rollout, "stats": stats}

    # ------------------------------------------------------------------ state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[self.checkpoint_key] = self.rl_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(self.checkpoint_key)
        if state is None:
            raise KeyError(f"not a {type(self).__name__} checkpoint: no '{self.checkpoint_key}' state "
                           "(iteration, KL controller, running statistics)")  # fmt: skip
        self.load_rl_state_dict(state)
