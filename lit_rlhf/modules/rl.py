"""``RLModule``: the RL iteration, written once, and the public interface callbacks use.

Every RL stage (PPO / PPO-max, GRPO and its presets DAPO, Dr. GRPO, RLOO, REINFORCE++, ReMax) runs one RL iteration
per ``training_step`` under manual optimization, and this class writes that iteration ONCE
(docs/architecture.md "One RL iteration"):

1. :meth:`collect` — sample the stage's responses to a batch of prompts through the one rollout
   path (lit_rlhf/rollout/collect.py) and score them with every model the run holds (policy,
   reference, critic, reward); a stage may filter or extend the rollout
   (:meth:`refine_rollout`, DAPO's dynamic sampling). When the update is one pass over one
   minibatch (:meth:`fused_first_forward`), the policy (and critic) are scored by the update's
   own first forward instead: exact, and cheaper;
2. :meth:`compute_advantages` — THE stage hook: GAE + whitening (PPO), group baselines (GRPO,
   RLOO, Dr. GRPO), KL-shaped returns-to-go with a batch-wide or greedy baseline (REINFORCE++, ReMax);
3. :meth:`update` (lit_rlhf/modules/rl_update.py) — ``num_passes()`` × shuffled minibatches of
   :meth:`minibatch_loss` (the other stage hook), one backward + one optimizer step each;
4. :meth:`update_kl_controller` and :meth:`end_iteration` — β's controller sees the KL of all
   ranks' rollouts; statistics are reduced over ranks, logged, and returned as
   ``{"rollout", "stats"}`` for the monitor callbacks.

β has one source: :attr:`kl_ctl` (fixed or adaptive). Every loss and reward reads
:meth:`kl_loss` / ``self.kl_ctl.value``; the collapse alarm raises it through
:meth:`scale_kl_coef`, and ``kl_ctl/beta`` logs it. The frozen reference (the starting policy)
is loaded whenever β > 0, and with β = 0 too unless ``algo.monitor_kl=false``: KL to the
starting policy is the first stability signal (docs/metrics.md).

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

from lit_rlhf.core.kl import AdaptiveKLController, FixedKLController, sequence_kl
from lit_rlhf.core.mismatch import sampler_mismatch
from lit_rlhf.core.types import Rollout
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.base import RLHFModule, policy_spec
from lit_rlhf.modules.configs import RLConfig
from lit_rlhf.modules.health import TrainingHealth
from lit_rlhf.modules.rl_update import PolicyForward, RLUpdateMixin, has_dropout
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.utils.config import ConfigError

__all__ = ["PolicyForward", "RLModule", "has_dropout"]

log = logging.getLogger(__name__)


class RLModule(RLUpdateMixin, RLHFModule):
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
        c: RLConfig = self.config
        self.actor: nn.Module | None = None
        self.critic: nn.Module | None = None  # PPO's value model; critic-free stages keep None
        self.frozen: dict[str, nn.Module] = {}
        self.scorer: Any = None
        self.gold_scorer: Any = None
        # β's one source (docs/algorithms.md §2.3): every loss, reward and log reads it here
        if c.adaptive_kl:
            self.kl_ctl = AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(c.kl_coef)
        self.iteration = 0
        self.health = TrainingHealth(c.max_bad_iterations, "the reward")
        self._first_forward: PolicyForward | None = None  # the fused path's, for update()

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
        """β ← max(β, floor) · factor (β = 0 could not be raised by a factor); returns (old, new).

        The raised β acts in the next iteration's loss or reward, since both read ``kl_ctl``.
        A run without a reference model (β = 0 and ``algo.monitor_kl=false``) has no KL to
        weigh: β is raised all the same (and logged), and a warning says that it cannot act."""
        old = self.kl_ctl.value
        self.kl_ctl.value = max(old, floor) * factor
        if "reference" not in self.frozen:
            log.warning(
                "β raised %.4g -> %.4g, but this run holds no reference model (β was 0 and "
                "algo.monitor_kl=false): there is no KL term for it to weigh; set algo.monitor_kl=true "
                "(or algo.kl_coef > 0) for a rollback that can pull the policy back",
                old,
                self.kl_ctl.value,
            )
        return old, self.kl_ctl.value

    def rl_state_dict(self) -> dict[str, Any]:
        """Non-parameter training state; subclasses add theirs (e.g. PPO's running reward moments)."""
        return {"iteration": self.iteration, "kl_ctl": self.kl_ctl.state_dict(), "health": self.health.state_dict()}

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.health.load_state_dict(state.get("health", {}))

    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        """Optimizer steps of one RL iteration of ``batch_size`` responses (default: a full rollout)."""
        n = self.config.rollout_batch_size if batch_size is None else batch_size
        return self.num_passes() * math.ceil(n / self.minibatch_rows(n))

    # ------------------------------------------------------------ stage hooks
    def responses_per_prompt(self) -> int:
        """Responses sampled per prompt (GRPO's group size G; 1 for PPO)."""
        return 1

    def num_passes(self) -> int:
        """Passes of the update over each rollout (PPO's ``ppo_epochs``, GRPO's μ)."""
        return 1

    def minibatch_rows(self, n: int) -> int:
        """Responses per optimizer step when the rollout holds ``n``."""
        return n

    def entropy_in_loss(self) -> bool:
        """Whether the policy entropy needs a graph (an entropy term in the loss)."""
        return False

    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Fill ``rollout.advantages`` (and whatever else the loss reads); return statistics."""
        raise NotImplementedError

    def minibatch_loss(
        self, mb: Rollout, fwd: PolicyForward, ptx: dict[str, Tensor] | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one minibatch (everything trained, one backward) and its named statistics."""
        raise NotImplementedError

    def refine_rollout(self, rollout: Rollout, batch: dict[str, Any], fused: bool) -> tuple[Rollout, dict[str, Tensor]]:
        """After sampling, before the fused forward: drop or add responses (DAPO's dynamic
        sampling); default: the rollout as sampled, no statistics."""
        return rollout, {}

    @classmethod
    def needs_reference(cls, config: RLConfig) -> bool:
        """Whether the run holds the frozen reference: for the KL term (β > 0), or to monitor the
        KL to the starting policy (``algo.monitor_kl``, on by default)."""
        return config.kl_coef > 0 or config.monitor_kl

    @classmethod
    def planned_models(cls, config: RLConfig) -> list[tuple[str, str, str | None]]:
        """(name, role, path or None = the model group's) of every model a run holds, for the
        memory plan (lit_rlhf/memory_plan.py): the stage says what it builds."""
        out = [("actor", "trained", config.policy_path)]
        if cls.needs_reference(config):
            out.append(("reference", "frozen-ref", config.policy_path))
        if config.reward_path:
            out.append(("reward model", "frozen", config.reward_path))
        return out

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
        """``self.actor`` (trainable) and, when :meth:`needs_reference`, ``self.frozen["reference"]``
        from the same weights."""
        from lit_rlhf.models.builders import build_causal_lm, freeze

        tok = self.ensure_tokenizer()
        self.actor = self.with_lora(build_causal_lm(self.model_spec, tok)).train()
        if self.needs_reference(self.config):
            self.frozen["reference"] = self.reference_for(
                self.actor, lambda: freeze(build_causal_lm(self.model_spec, tok))
            )

    def build_rewards(self) -> None:
        """``self.scorer`` from ``reward_path`` (a frozen reward model) or ``reward_fn``, and the
        validation-only ``self.gold_scorer``."""
        from hydra.utils import instantiate

        from lit_rlhf.models.builders import build_tokenizer, freeze, resolve_path
        from lit_rlhf.models.reward import load_reward_model
        from lit_rlhf.rollout.score import CallableScorer, ModelScorer, WeightedScorer

        c: RLConfig = self.config
        self.health.reward_name = (
            f"the reward model {c.reward_path}"
            if c.reward_path
            else f"reward_fn {c.reward_fn['_target_']}"
            if c.reward_fn
            else "reward_fns"
        )
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
            raise ValueError(
                f"the prompt loader's batch ({dm.config.batch_size}) is not the {prompts} prompts of "
                f"algo.rollout_batch_size={self.config.rollout_batch_size}: build the data module with "
                "that batch size"
            )
        for m in self.frozen.values():
            m.to(self.device)
        self._set_scorer_template()
        ptx_source = getattr(getattr(dm, "config", None), "ptx_source", None)
        if ptx_source and not getattr(self.config, "ptx_coef", 0.0):
            log.warning(
                "data.prompt.ptx_source=%s is set but %s: its batches are loaded and never used (set "
                "algo.ptx_coef > 0 with algo=ppo*, or drop the source)",
                ptx_source,
                "algo.ptx_coef=0" if hasattr(self.config, "ptx_coef") else "this stage has no PPO-ptx term",
            )

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # trainer.validate() before fit: no on_fit_start
            self.on_fit_start()

    def _set_scorer_template(self) -> None:
        from lit_rlhf.data.templates import get_template
        from lit_rlhf.rollout.score import ModelScorer

        if isinstance(self.scorer, ModelScorer) and self.scorer.template is None:
            dm = self.trainer.datamodule
            self.scorer.template = get_template(dm.config.template if dm is not None else "plain")

    # --------------------------------------------------------- the iteration
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """One RL iteration: collect → advantages → update → β controller → statistics."""
        prompts, ptx = (batch["prompts"], batch["ptx"]) if "ptx" in batch else (batch, None)
        started = time.perf_counter()
        rollout, stats = self.collect(prompts)
        self.engine_sleep()  # GPU, vllm with sleep: the update gets the engine's memory
        collected = time.perf_counter()
        stats.update(self.compute_advantages(rollout))
        stats.update(self.reward_stats())
        stats.update(self.update(rollout, ptx))
        self.update_kl_controller(rollout)
        return self.end_iteration(rollout, stats, started, collected)

    def reward_stats(self) -> dict[str, Tensor]:
        """``reward/<name>``: each ``algo.reward_fns`` component's mean over the last scored batch
        (finite values); ``reward/<name>_errors``: responses a reward function could not check in
        this iteration (scored 0 and counted, docs/rewards.md), with a warning naming the first."""
        from lit_rlhf.rollout.score import CallableScorer, WeightedScorer

        stats = {
            f"reward/{name}": v[torch.isfinite(v)].mean() for name, v in getattr(self.scorer, "components", {}).items()
        }
        if isinstance(self.scorer, WeightedScorer):
            errors = self.scorer.take_errors()
        elif isinstance(self.scorer, CallableScorer):
            errors = {self.scorer.name.rsplit(".", 1)[-1]: self.scorer.take_errors()}
        else:
            errors = {}
        for name, (count, example) in errors.items():
            stats[f"reward/{name}_errors"] = torch.tensor(float(count))
            if count:
                log.warning(
                    "iteration %d: reward %s could not check %d responses (scored 0), e.g.: %s",
                    self.iteration,
                    name,
                    count,
                    example,
                )
        return stats

    # ------------------------------------------------------------------ rollout
    def rollout_grad_mode(self) -> Any:
        """The rollout's context (generation and scoring): :meth:`RLHFModule.sampling_mode` (under
        ZeRO-3 and FSDP it gathers every trained model, the critic too, for the whole rollout)."""
        return self.sampling_mode(self.actor)

    def logprob_temperature(self) -> float:
        c: RLConfig = self.config
        return c.generation.temperature if c.logprobs_at_sampling_temperature else 1.0

    def sample(self, batch: dict[str, Any], policy_logprobs: bool = True) -> Rollout:
        """:meth:`responses_per_prompt` responses to each prompt of ``batch`` (a prompt's rows are
        consecutive), scored by every model the run holds; the policy (and critic) only when
        ``policy_logprobs`` (False: the fused first forward scores them)."""
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor,
                batch,
                self.tokenizer,
                self.config.generation,
                reference=self.frozen.get("reference"),
                critic=self.critic if policy_logprobs else None,
                scorer=self.scorer,
                policy_logprobs=policy_logprobs,
                logprob_temperature=self.logprob_temperature(),
                padding_free=self.config.padding_free,
                sampler_logprobs=self.keeps_sampler_logprobs(),
                engine=self.rollout_engine(self.actor),
                responses_per_prompt=self.responses_per_prompt(),
            )
        return rollout.normal_tensors()

    def keeps_sampler_logprobs(self) -> bool:
        """Whether rollouts keep the sampler's own log-probs (the mismatch monitor, TIS)."""
        c: RLConfig = self.config
        return c.monitor_sampler or c.rollout_correction != "none"

    def collect(self, batch: dict[str, Any]) -> tuple[Rollout, dict[str, Tensor]]:
        """The iteration's complete rollout (old log-probs, values when there is a critic, scores;
        reference log-probs when there is a reference) and its sampling statistics
        (docs/algorithms.md §2.1).

        When the update is ONE pass over ONE minibatch (:meth:`fused_first_forward`), the policy
        and critic are scored by the update's own first forward (with grad; kept for
        :meth:`update`) instead of separate no-grad passes: exact, and two forwards cheaper.
        """
        fused = self.fused_first_forward(batch["prompt_ids"].shape[0] * self.responses_per_prompt())
        rollout, stats = self.refine_rollout(self.sample(batch, policy_logprobs=not fused), batch, fused)
        if fused:
            self._first_forward = self.policy_forward(rollout)
            rollout.logprobs = self._first_forward.logprobs.detach()
            if self.critic is not None:
                rollout.values = self._first_forward.values.detach()
        required = ["logprobs", "scores"] + ["values"] * (self.critic is not None)
        if self.engine is not None:
            stats["perf/engine_sync_s"] = torch.tensor(self.engine.take_sync_seconds())
        if rollout.sampler_logprobs is not None:  # the sampler–trainer mismatch (docs/algorithms.md §2.10)
            stats.update(
                {
                    f"rollout/{k}": v
                    for k, v in sampler_mismatch(rollout.logprobs, rollout.sampler_logprobs, rollout.valid_mask).items()
                }
            )
        return rollout.require(*required, *["ref_logprobs"] * ("reference" in self.frozen)), stats

    def fused_first_forward(self, batch_size: int) -> bool:
        """Whether the rollout-time policy/critic passes can be the first training forward.

        With one pass over one minibatch, the weights the update starts from ARE the rollout
        weights, so log π_old (and V_old) equal that forward's outputs, detached — exactly, as
        long as no dropout makes train-mode and eval-mode forwards differ (TRL's GRPO takes its
        old log-probs the same way). ``algo.fuse_first_forward=false`` turns it off.
        """
        one_update = self.num_passes() == 1 and self.minibatch_rows(batch_size) >= batch_size
        return (
            self.config.fuse_first_forward and one_update and not (has_dropout(self.actor) or has_dropout(self.critic))
        )

    def evaluation_rollout(self, batch: dict[str, Any]) -> Rollout:
        """One sampled response per prompt, scored by the policy, the reference and the reward."""
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor,
                batch,
                self.tokenizer,
                self.config.generation,
                reference=self.frozen.get("reference"),
                scorer=self.scorer,
                logprob_temperature=self.logprob_temperature(),
                padding_free=self.config.padding_free,
                engine=self.rollout_engine(self.actor),
            )
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
            gold = self.gold_scorer(
                rollout.input_ids,
                rollout.attention_mask,
                rollout.prompts_text,
                rollout.responses_text,
                rollout.ended,
                columns=rollout.columns,
            )
            self.log("val/gold_score_mean", gold.mean(), batch_size=n, sync_dist=True)
        if self.config.val_pass_k:
            from lit_rlhf.rollout.evaluate import evaluate_verifiable

            with self.rollout_grad_mode():
                ev = evaluate_verifiable(
                    self.actor,
                    batch,
                    self.tokenizer,
                    self.config.generation,
                    self.gold_scorer or self.scorer,
                    self.config.val_pass_k,
                    self.config.val_correct_at,
                    self.config.padding_free,
                    engine=self.rollout_engine(self.actor),
                )
            for key, value in ev.metrics().items():
                self.log(f"val/{key}", value, batch_size=n, sync_dist=True, prog_bar=key == "greedy_accuracy")

    def total_updates(self) -> int:
        """Optimizer steps of the whole fit: trainer.max_steps, else batches × updates per batch."""
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        batches = self.trainer.estimated_stepping_batches  # manual optimization: counts batches
        if not math.isfinite(batches):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the lr schedule needs a length")
        return max(1, int(batches) * self.updates_per_iteration())

    def end_iteration(
        self, rollout: Rollout, stats: dict[str, Tensor], started: float, collected: float
    ) -> dict[str, Any]:
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
            raise KeyError(
                f"not a {type(self).__name__} checkpoint: no '{self.checkpoint_key}' state "
                "(iteration, KL controller, running statistics)"
            )
        self.load_rl_state_dict(state)
