"""``RLModule``: the RL iteration of every RL stage, written once, top to bottom.

Every RL stage (PPO / PPO-max; the critic-free family: GRPO, DAPO, Dr. GRPO, RLOO, REINFORCE++,
ReMax) runs one RL iteration per ``training_step`` under manual optimization. This file is that
iteration, in the order it runs (docs/architecture.md "One RL iteration"):

1. **collect** — sample the stage's responses to a batch of prompts through the one rollout path
   (lit_rlhf/rollout/collect.py) and score them with every model the run holds (policy, reference,
   critic, reward); a stage may filter or extend the rollout (:meth:`refine_rollout`: DAPO's dynamic
   sampling). When the update is one pass over one minibatch (:meth:`fused_first_forward`), the policy
   (and critic) are scored by the update's own first forward instead: exact, and cheaper;
2. **advantages** — :meth:`compute_advantages`, THE stage hook: GAE + whitening (PPO), group baselines
   (GRPO, RLOO, Dr. GRPO), KL-shaped returns-to-go with a batch-wide or greedy baseline (REINFORCE++,
   ReMax);
3. **update** — ``num_passes()`` × shuffled minibatches of :meth:`minibatch_loss` (the other stage
   hook), one optimizer step each (the backward of each micro-batch between: gradient accumulation,
   every term divided by the whole minibatch's counts); a non-finite loss or gradient is a counted skip;
4. **end of iteration** — β's controller sees the KL of all ranks' rollouts; the statistics are
   reduced over ranks, logged, and returned as ``{"rollout", "stats"}`` for the monitor callbacks.

The sections below follow those phases; after them come validation, the models and rewards, the
runner's hooks, and the interface the callbacks use.

β has one source: :attr:`kl_ctl` (fixed or adaptive). Every loss and reward reads :meth:`kl_loss` /
``self.kl_ctl.value``; the collapse alarm raises it through :meth:`scale_kl_coef`, and ``kl_ctl/beta``
logs it. The frozen reference (the starting policy) is loaded whenever β > 0, and with β = 0 too
unless ``algo.monitor_kl=false``: KL to the starting policy is the first stability signal
(docs/metrics.md).

Callbacks talk to an RL stage only through :class:`lit_rlhf.callbacks.protocol.RLStage`, which this
class implements: :attr:`rl_iteration`, :attr:`kl_coef`, :meth:`scale_kl_coef`,
:meth:`rl_state_dict` / :meth:`load_rl_state_dict`, :meth:`updates_per_iteration`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.core.kl import AdaptiveKLController, FixedKLController, kl_penalty, sequence_kl
from lit_rlhf.core.losses import aggregate
from lit_rlhf.core.masked import masked_mean
from lit_rlhf.core.mismatch import correction_weights, sampler_mismatch
from lit_rlhf.core.objectives import POLICY_LOSSES
from lit_rlhf.core.types import Rollout
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.base import RLHFModule, policy_spec
from lit_rlhf.modules.configs import RLConfig
from lit_rlhf.modules.health import TrainingHealth, all_ranks_finite
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.rollout.forward import response_logprobs, response_values
from lit_rlhf.utils.compat.torch import set_num_threads
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.distributed import all_reduce_max, all_reduce_sum
from lit_rlhf.utils.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossCounts:
    """What the loss terms of one minibatch divide by, when it is sharded over ranks or split into
    micro-batches (:meth:`RLModule.loss_counts`, docs/algorithms.md §6)."""

    tokens: Tensor  # response tokens: token_mean, the value, entropy terms
    rows: Tensor  # responses: seq_mean_token_mean, seq_sum_constant

    def for_aggregation(self, mode: str) -> Tensor:
        """The count ``algo.loss_aggregation=mode`` divides by."""
        return self.tokens if mode == "token_mean" else self.rows


@dataclass
class PolicyForward:
    """One training forward of the policy (and the critic, when the stage has one) over a minibatch, with grad."""

    logprobs: Tensor  # (B, R) log π_θ(y_t | x, y_<t)
    entropy: Tensor  # (B, R) H(π_θ(·|s_t)); in the graph only when the entropy is in the loss
    values: Tensor | None  # (B, R) V_θ(s_t); None without a critic


class RLModule(RLHFModule):
    """Base of the RL stages: policy ``self.actor``, optional critic ``self.critic``, frozen models in
    ``self.frozen`` (a plain dict: neither optimized nor checkpointed; they reload from their paths)."""

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
        self.agent: Any = None  # the multi-turn rollout (algo.environment), built at the first rollout
        self.producer: Any = None  # the asynchronous rollouts' producer (algo.rollout.mode=async)
        # β's one source (docs/algorithms.md §2.3): every loss, reward and log reads it here
        if c.adaptive_kl:
            self.kl_ctl = AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(c.kl_coef)
        self.iteration = 0
        self.health = TrainingHealth(c.max_bad_iterations, "the reward")
        self._first_forward: PolicyForward | None = None  # the fused path's, for update()

    # =================================================================== the iteration
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """One RL iteration: collect → advantages → update → end of iteration."""
        prompts, ptx = (batch["prompts"], batch["ptx"]) if "ptx" in batch else (batch, None)
        started = time.perf_counter()

        # 1. collect: G responses per prompt, scored by every model the run holds
        rng = capture_rng()  # put back when the reward service is down: the batch is redone on resume
        rollout, stats = self.collect(prompts)
        self.stop_if_reward_service_down(rng)
        self.engine_sleep()  # GPU, vllm with sleep: the update gets the engine's memory
        collected = time.perf_counter()

        # 2. advantages: the stage's hook fills rollout.advantages (and what its loss reads)
        stats.update(self.compute_advantages(rollout))
        stats.update(self.reward_stats())

        # 3. update: num_passes() x minibatches of minibatch_loss, one backward + one step each
        stats.update(self.update(rollout, ptx))

        # 4. end of iteration: β's controller, statistics over ranks, logs, the monitors' output
        self.update_kl_controller(rollout)
        return self.end_iteration(rollout, stats, started, collected)

    # ------------------------------------------------------------------- 1. collect
    def collect(self, batch: dict[str, Any]) -> tuple[Rollout, dict[str, Tensor]]:
        """The iteration's complete rollout (old log-probs, values when there is a critic, scores;
        reference log-probs when there is a reference) and its sampling statistics
        (docs/algorithms.md §2.1).

        When the update is ONE pass over ONE minibatch (:meth:`fused_first_forward`), the policy
        and critic are scored by the update's own first forward (with grad; kept for
        :meth:`update`) instead of separate no-grad passes: exact, and two forwards cheaper.
        """
        fused = self.fused_first_forward(batch["prompt_ids"].shape[0] * self.responses_per_prompt())
        drawn, produced = self.produced(batch)
        rollout, stats = self.refine_rollout(self.sample(batch, policy_logprobs=not fused, drawn=drawn), batch, fused)
        stats.update(produced)
        if fused:
            self._first_forward = self.policy_forward(rollout)
            rollout.logprobs = self._first_forward.logprobs.detach()
            if self.critic is not None:
                rollout.values = self._first_forward.values.detach()
        required = ["logprobs", "scores"] + ["values"] * (self.critic is not None)
        counts = drawn.agent_counts if drawn is not None else None  # the producer's trajectories
        if self.agent is not None or counts:  # every trajectory of the iteration (ReMax's greedy ones included)
            from lit_rlhf.rollout.agent import summarize_counts

            agent = self.agent.take_stats(counts) if self.agent is not None else summarize_counts(counts)
            stats.update({f"agent/{k}": torch.tensor(v) for k, v in agent.items()})
        if self.engine is not None:
            stats["perf/engine_sync_s"] = torch.tensor(self.engine.take_sync_seconds())
        if rollout.sampler_logprobs is not None:  # the sampler–trainer mismatch (docs/algorithms.md §2.10)
            mismatch = sampler_mismatch(rollout.logprobs, rollout.sampler_logprobs, rollout.valid_mask)
            stats.update({f"rollout/{k}": v for k, v in mismatch.items()})
        return rollout.require(*required, *["ref_logprobs"] * ("reference" in self.frozen)), stats

    def stop_if_reward_service_down(self, rng: dict[str, Any]) -> None:
        """Every endpoint of a remote reward stayed down (lit_rlhf/rewards/http.py): stop cleanly
        after a checkpoint that redoes this iteration (:meth:`checkpoint_to_redo`), so that
        ``ckpt_path=last`` continues as if the outage never happened. Every rank takes the same
        branch (the flag is summed over ranks)."""
        outage = self.scorer.take_outage() if self.scorer is not None else None
        if not self.on_any_rank(outage is not None):
            return
        from lit_rlhf.rewards.http import RewardServiceDown

        path = self.checkpoint_to_redo(rng)
        raise RewardServiceDown(
            f"{outage or 'a remote reward is down on another rank'}. Training stopped at RL iteration "
            f"{self.iteration} before its update; checkpoint: {path}. Once an endpoint answers again, "
            "run the same command with ckpt_path=last."
        )

    def on_any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (collective: every rank must ask)."""
        return float(all_reduce_sum(torch.tensor([float(flag)], device=self.device))[0]) > 0.0

    def checkpoint_to_redo(self, rng: dict[str, Any] | None) -> str:
        """Write ``last.ckpt`` in the checkpoint folder so that a resume redoes the running iteration:
        the RNG put back to the iteration's start (``rng``; None: nothing was drawn since), the
        training loaders one batch back. Collective (every rank saves); returns the path."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        from lit_rlhf.utils.compat.lightning import combined_loader

        if rng is not None:
            restore_rng(rng)
        combined = combined_loader(self.trainer)
        for loader in combined.flattened if combined is not None else []:
            if callable(getattr(loader, "rewind", None)):
                loader.rewind()
        folder = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        folder = folder or os.path.join(self.trainer.default_root_dir, "checkpoints")
        path = os.path.join(folder, ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION)
        # Lightning has counted the running batch as started, and its restart logic knows checkpoints
        # saved at a batch's end: saved as the end of the batch before (what a periodic checkpoint
        # holds), the resume starts this batch again, and validates and logs at the uninterrupted
        # run's steps (the batch count drives a val_check_interval schedule)
        loop = self.trainer.fit_loop.epoch_loop
        counted, stepped = loop.batch_progress.state_dict(), loop._batches_that_stepped
        for tracker in (loop.batch_progress.total, loop.batch_progress.current):
            tracker.ready = tracker.started = tracker.processed = tracker.completed
            tracker.completed -= 1
        loop._batches_that_stepped -= 1
        try:
            self.trainer.save_checkpoint(path)
        finally:
            loop.batch_progress.load_state_dict(counted)
            loop._batches_that_stepped = stepped
        return path

    def sample(self, batch: dict[str, Any], policy_logprobs: bool = True, drawn: Any = None) -> Rollout:
        """:meth:`responses_per_prompt` responses to each prompt of ``batch`` (a prompt's rows are
        consecutive), scored by every model the run holds; the policy (and critic) only when
        ``policy_logprobs`` (False: the fused first forward scores them). ``drawn``: the producer's
        sample of ``batch`` (:meth:`produced`), scored instead of sampling here."""
        c: RLConfig = self.config
        with self.rollout_grad_mode():
            rollout = generate_and_score(
                self.actor,
                batch,
                self.tokenizer,
                c.generation,
                reference=self.frozen.get("reference"),
                critic=self.critic if policy_logprobs else None,
                scorer=self.scorer,
                policy_logprobs=policy_logprobs,
                logprob_temperature=self.logprob_temperature(),
                padding_free=c.padding_free,
                sampler_logprobs=c.monitor_sampler or c.rollout_correction != "none",
                engine=self.rollout_engine(self.actor),
                responses_per_prompt=self.responses_per_prompt(),
                agent=self.agent_loop() if drawn is None else None,
                drawn=drawn.drawn if drawn is not None else None,
                ref_logprobs=drawn.ref_logprobs if drawn is not None else None,
            )
        return rollout.normal_tensors()

    def produced(self, batch: dict[str, Any]) -> tuple[Any, dict[str, Tensor]]:
        """Asynchronous rollouts (``algo.rollout.mode=async``, lit_rlhf/rollout/producer.py): hand the
        producer this iteration's prompts and those the loader looked ahead at (``batch["ahead"]``,
        each ticket once), and take this iteration's sample (the rollout path's output, its policy
        version) with its statistics. Bound 0: the trainer's random state goes with the ticket and
        comes back with the sample, as if the trainer had sampled. Sync: (None, {})."""
        ahead = batch.pop("ahead", [])
        c = self.config.rollout
        if c.mode == "sync":
            return None, {}
        from lit_rlhf.rollout.producer import ProducerError, moved

        producer, k = self.rollout_producer(), self.iteration
        producer.hand_out(k, [batch, *ahead], capture_rng if c.max_staleness == 0 else None)
        asked = time.perf_counter()
        try:
            drawn, failure = producer.take(k), None
        except (ProducerError, ConfigError) as err:  # every rank stops, after a checkpoint that redoes k
            drawn, failure = None, err
        if self.on_any_rank(failure is not None):
            self.stop_for_the_producer(failure)
        if drawn.rng is not None:
            restore_rng(drawn.rng)
        if self.device.type != "cpu":  # it crossed through CPU memory
            drawn.drawn, drawn.ref_logprobs = moved((drawn.drawn, drawn.ref_logprobs), self.device)
        return drawn, producer.stats(k, drawn, time.perf_counter() - asked)

    def stop_for_the_producer(self, failure: Exception | None) -> None:
        """The producer failed (on this rank: ``failure``; else on another): stop after a checkpoint
        that redoes this iteration (nothing was drawn from the trainer's RNG since it started; the
        loader re-issues its tickets on resume), raising the producer's error with its path."""
        from lit_rlhf.rollout.producer import ProducerError

        path = self.checkpoint_to_redo(None)
        resume = f"Training stopped at RL iteration {self.iteration}; checkpoint: {path} (ckpt_path=last redoes it)"
        if isinstance(failure, ConfigError):
            raise ConfigError(failure.key, f"{failure.message.rstrip('.')}. {resume}") from failure
        said = str(failure or "the rollout producer of another rank failed").rstrip(".")
        raise ProducerError(f"{said}. {resume}") from failure

    def rollout_producer(self) -> Any:
        """The producer of ``algo.rollout.mode=async`` (lit_rlhf/rollout/producer.py), started at the
        first call with the policy's weights as version :attr:`rl_iteration`, its torch threads
        taken from the trainer's; stopped in :meth:`teardown`. Under any strategy, on this rank's
        device (the CPU or its GPU) and under the training step's autocast: where the weights are
        shards (ZeRO-3, FSDP) they are gathered in :meth:`sampling_mode` for it."""
        if self.producer is not None:
            return self.producer
        from lit_rlhf.rollout.agent import agent_settings, check_agent_tokenizer
        from lit_rlhf.rollout.producer import AsyncRollouts, ProducerError, ProducerSettings, split_threads

        c: RLConfig = self.config
        whole = self.weights_are_whole()
        reference = self.frozen.get("reference") if c.rollout.reference_scoring != "trainer" else None
        self.check_producer_placement(whole, reference)
        settings = None
        if c.environment is not None:
            check_agent_tokenizer(self.tokenizer)
            dm = getattr(self.trainer, "datamodule", None)
            settings = agent_settings(c, getattr(getattr(dm, "config", None), "max_prompt_length", None))
        kind = self.device.type  # the training step's autocast (bf16-mixed), for the producer's sampling too
        autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        self._threads = torch.get_num_threads()
        mine, self._training_threads = split_threads(self._threads, c.rollout.max_staleness, c.rollout.producer_threads)
        set_num_threads(self._training_threads)
        sampler = c.monitor_sampler or c.rollout_correction != "none"
        self.producer = AsyncRollouts(
            self.actor,
            self.tokenizer,
            ProducerSettings(
                gen=c.generation,
                responses_per_prompt=self.responses_per_prompt(),
                logprob_temperature=self.logprob_temperature() if sampler else None,
                agent=settings,
                reference=reference,
                score_temperature=self.logprob_temperature(),
                padding_free=c.padding_free,
                reference_scoring=c.rollout.reference_scoring,
                vllm_logprobs=self.vllm_logprobs_mode(),
                seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # the run's seed (pl.seed_everything)
                threads=mine,
                merge_rollouts=c.rollout.merge_rollouts,
                device=str(self.device),
                autocast=autocast,
            ),
            c.rollout.max_staleness,
            c.rollout.restarts,
            c.rollout.timeout_s,
            whole=whole,
            gathered=lambda: self.sampling_mode(self.actor),
            sharing=getattr(self._trainer, "num_devices", 1),  # the ranks of this host start theirs at once
        )
        failure = None
        try:
            self.producer.start(self.iteration)
        except Exception as err:  # e.g. no room for its weights: every rank stops (one alone would hang the rest)
            failure = err
        if self.on_any_rank(failure is not None):
            raise failure or ProducerError("the rollout producer of another rank could not start")
        return self.producer

    def check_producer_placement(self, whole: bool, reference: Any) -> None:
        """What a producer cannot do where this rank runs, refused before it starts: a device other
        than the CPU or a CUDA GPU; scoring a ``reference`` (None: the trainer scores it) that is the
        sharded policy with its LoRA adapters off (not ``whole``), or on a GPU (it would need a
        copy of the reference on the card, or its memory shared before the producer has its GPU)."""
        from lit_rlhf.models.lora import AdaptersDisabled

        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(
                "algo.rollout.mode",
                f"async rollouts run on the CPU or a CUDA GPU (every rank with a producer of its own); "
                f"this run is on {self.device.type}; use algo.rollout.mode=sync",
            )
        if not whole and isinstance(reference, AdaptersDisabled):
            raise ConfigError(
                "algo.rollout.reference_scoring",
                "the frozen reference shares the sharded policy's weights (LoRA adapters off): only the "
                "trainer can score it; use algo.rollout.reference_scoring=trainer",
            )
        if reference is not None and self.device.type != "cpu":
            raise ConfigError(
                "algo.rollout.reference_scoring",
                "on a GPU only the trainer scores the frozen reference (the producer would need a copy of it "
                "on the card, or its memory shared before the producer has its GPU); use "
                "algo.rollout.reference_scoring=trainer",
            )

    def agent_loop(self) -> Any:
        """The multi-turn rollout of ``algo.environment`` (lit_rlhf/rollout/agent.py), built at the
        first call and released in :meth:`teardown`; None = one turn."""
        c: RLConfig = self.config
        if c.environment is None:
            return None
        if self.agent is None:
            from lit_rlhf.rollout.agent import AgentLoop, agent_settings, check_agent_tokenizer

            check_agent_tokenizer(self.tokenizer)
            dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            settings = agent_settings(c, getattr(getattr(dm, "config", None), "max_prompt_length", None))
            self.agent = AgentLoop(settings)
        return self.agent

    def refine_rollout(self, rollout: Rollout, batch: dict[str, Any], fused: bool) -> tuple[Rollout, dict[str, Tensor]]:
        """Stage hook, after sampling and before the fused forward: drop or add responses (DAPO's
        dynamic sampling); default: the rollout as sampled, no statistics."""
        return rollout, {}

    def fused_first_forward(self, batch_size: int) -> bool:
        """Whether the rollout-time policy/critic passes can be the first training forward.

        With one pass over one minibatch, the weights the update starts from ARE the rollout
        weights, so log π_old (and V_old) equal that forward's outputs, detached — exactly, as
        long as no dropout makes train-mode and eval-mode forwards differ (TRL's GRPO takes its
        old log-probs the same way). ``algo.fuse_first_forward=false`` turns it off; micro-batches
        (``algo.micro_batch_size`` below the rollout) forward one at a time, so they are not fused.
        """
        one_update = self.num_passes() == 1 and self.minibatch_rows(batch_size) >= batch_size
        one_update = one_update and (self.config.micro_batch_size or batch_size) >= batch_size
        dropout = has_dropout(self.actor) or has_dropout(self.critic)
        return self.config.fuse_first_forward and one_update and not dropout

    def rollout_grad_mode(self) -> Any:
        """The rollout's context (generation and scoring): :meth:`RLHFModule.sampling_mode` (under
        ZeRO-3 and FSDP it gathers every trained model, the critic too, for the whole rollout)."""
        return self.sampling_mode(self.actor)

    def logprob_temperature(self) -> float:
        c: RLConfig = self.config
        return c.generation.temperature if c.logprobs_at_sampling_temperature else 1.0

    # ---------------------------------------------------------------- 2. advantages
    def compute_advantages(self, rollout: Rollout) -> dict[str, Tensor]:
        """Stage hook: fill ``rollout.advantages`` (and whatever else the loss reads); return statistics."""
        raise NotImplementedError

    def reward_stats(self) -> dict[str, Tensor]:
        """``reward/<name>``: each ``algo.reward_fns`` component's mean over the last scored batch
        (finite values); ``reward/<name>_errors``: responses a reward function could not score in
        this iteration (a verifier scores them 0, a remote reward leaves them NaN — out of the
        update and excused by the health check; docs/rewards.md), with a warning naming the first."""
        components = getattr(self.scorer, "components", {})
        stats = {f"reward/{name}": v[torch.isfinite(v)].mean() for name, v in components.items()}
        self.health.excuse(self.scorer.take_unscored(), self.device)
        for name, (count, example) in self.scorer.take_errors().items():
            stats[f"reward/{name}_errors"] = torch.tensor(float(count))
            if count:
                log.warning(
                    "iteration %d: reward %s could not score %d responses (scored 0, or NaN and left out), e.g.: %s",
                    self.iteration,
                    name,
                    count,
                    example,
                )
        return stats

    # -------------------------------------------------------------------- 3. update
    def update(self, rollout: Rollout, ptx: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """:meth:`num_passes` × shuffled minibatches of one optimizer step each (:meth:`minibatch_step`;
        the fused path: one step on the whole rollout, in order, from the kept first forward).
        ``ptx`` (PPO-ptx's SFT batch) is split into as many chunks as there are minibatches."""
        opt, sched = self.optimizers(), self.lr_schedulers()
        first, self._first_forward = self._first_forward, None
        n = rollout.scores.shape[0]
        if first is not None:
            minibatches = [torch.arange(n)]
        else:
            # exact resume: the shuffle is a function of (epoch, iteration), not of a running generator
            gen = torch.Generator().manual_seed(int(self.trainer.current_epoch * 1_000_003 + self.iteration))
            minibatches = list(minibatch_indices(n, self.minibatch_rows(n), self.num_passes(), gen))
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
            stats = self.minibatch_step(opt, sched, mb, first, chunk)
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.detach().float())
        return mean_over_minibatches(collected)

    def minibatch_step(
        self, opt: Any, sched: Any, mb: Rollout, first: PolicyForward | None, ptx: dict[str, Tensor] | None
    ) -> dict[str, Tensor]:
        """One optimizer step on one minibatch. Its micro-batches of ``algo.micro_batch_size`` rows are
        forwarded and backpropagated one at a time (gradient accumulation), every loss term divided
        by the whole minibatch's counts (:meth:`loss_counts`), so their gradients add up to the
        minibatch's in one pass exactly; PPO-ptx's chunk joins the first micro-batch. A non-finite
        loss on any rank stops the accumulation and skips the step (counted). Returns the minibatch's
        statistics (:func:`sum_over_micro_batches`)."""
        n = mb.scores.shape[0]
        size = min(self.config.micro_batch_size or n, n)
        parts = [None] if size >= n else list(torch.arange(n, device=mb.scores.device).split(size))
        counts = self.loss_counts(mb.valid_mask)
        opt.zero_grad()
        finite, per_part = True, []
        for j, rows in enumerate(parts):
            part = mb if rows is None else mb.select(rows)
            loss, stats = self.minibatch_loss(part, first or self.policy_forward(part), ptx if j == 0 else None, counts)
            per_part.append(stats)
            finite = all_ranks_finite(loss.detach())
            if not finite:
                break
            self.manual_backward(loss)
        self.optimizer_step(opt, sched, finite)
        return sum_over_micro_batches(per_part)

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

    def minibatch_loss(
        self,
        mb: Rollout,
        fwd: PolicyForward,
        ptx: dict[str, Tensor] | None,
        counts: LossCounts | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Stage hook: the loss of one minibatch, or of one micro-batch of it (everything trained, one
        backward), and its named statistics; every term divides by ``counts`` (default: ``mb``'s own,
        :meth:`loss_counts`). It starts from :meth:`policy_loss`, the part every RL stage shares."""
        raise NotImplementedError

    def policy_loss(
        self, mb: Rollout, fwd: PolicyForward, counts: LossCounts | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy-gradient objective ``algo.policy_loss`` (lit_rlhf/core/objectives.py
        ``POLICY_LOSSES``; clip: the clipped surrogate with ε_low/ε_high and the dual clip) with the
        truncated importance weights of ``algo.rollout_correction``, + β·KL(π_θ‖π_ref) when the KL is
        in the loss (``kl_placement=loss``), both aggregated by ``algo.loss_aggregation``; responses
        without a finite reward are left out (``valid_mask``). Statistics under ``policy/``."""
        c: RLConfig = self.config
        mask = mb.valid_mask
        normalizer = (counts or self.loss_counts(mask)).for_aggregation(c.loss_aggregation)
        weights, correction = self.importance_weights(mb, mask)
        loss, pg = POLICY_LOSSES[c.policy_loss].fn(
            fwd.logprobs,
            mb.logprobs,
            mb.advantages,
            mask,
            c.clip_eps_low,
            c.clip_eps_high,
            c.dual_clip,
            c.loss_aggregation,
            self.aggregation_constant(),
            weights,
            normalizer,
        )
        stats = {f"policy/{k}": v for k, v in pg.items()}
        stats.update({f"rollout/{k}": v for k, v in correction.items()})
        stats["policy/entropy"] = masked_mean(fwd.entropy.detach(), mask)
        if c.kl_placement == "loss":
            kl_term, kl_stats = self.kl_loss(fwd.logprobs, mb, mask, normalizer)
            if kl_term is not None:
                loss = loss + kl_term
                stats.update(kl_stats)
        return loss, stats

    def loss_counts(self, mask: Tensor) -> LossCounts:
        """What every loss term of a minibatch divides by (docs/algorithms.md §6): its response tokens
        and its responses (those of ``mask``). Under ``loss_normalization=global`` they are summed over
        the ranks and divided by their number, so that the ranks' averaged gradient is the whole
        minibatch's whatever the sharding; under ``local``, this rank's own (the per-rank form). Every
        micro-batch of the minibatch divides by these same counts, so accumulation never changes the
        gradient. One all-reduce of two numbers per minibatch, with several ranks and ``global``."""
        tokens, rows = self.count_over_ranks(torch.stack([mask.sum(), mask.new_tensor(float(mask.shape[0]))]))
        return LossCounts(tokens=tokens, rows=rows)

    def count_over_ranks(self, local: Tensor) -> Tensor:
        """Counts (a 1-D tensor) as the loss divides by them: summed over ranks / their number under
        ``loss_normalization=global`` with several ranks, else this rank's own; at least 1 in total."""
        local = local.detach().float().to(self.device)
        world = self._trainer.world_size if self._trainer is not None else 1
        if world <= 1 or self.config.loss_normalization == "local":
            return local.clamp(min=1.0)
        return all_reduce_sum(local.clone()).clamp(min=1.0) / world

    def aggregation_constant(self) -> float:
        """The normaliser of ``loss_aggregation=seq_sum_constant``: the longest response, max_new_tokens."""
        return float(self.config.generation.max_new_tokens)

    def kl_loss(
        self, logprobs: Tensor, mb: Rollout, mask: Tensor, normalizer: Tensor | None = None
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """β · KL(π_θ‖π_ref) for the loss (GRPO's k3, PPO's ``kl_placement=loss``) with the policy
        loss's aggregation, β from :attr:`kl_ctl` — the same β the collapse alarm raises and
        ``kl_ctl/beta`` logs. None while β = 0 or without a reference."""
        beta = self.kl_ctl.value
        if not beta or mb.ref_logprobs is None:
            return None, {}
        per_token = kl_penalty(logprobs, mb.ref_logprobs, self.config.kl_estimator, mask=mask)
        kl = aggregate(per_token, mask, self.config.loss_aggregation, self.aggregation_constant(), normalizer)
        return beta * kl, {"policy/kl_loss": kl.detach()}

    def importance_weights(self, mb: Rollout, mask: Tensor) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Per-token weights of ``algo.rollout_correction`` for a sampler that is not the trainer
        (lit_rlhf/core/mismatch.py ``correction_weights``: truncated or masked, per token or per
        response, IcePop's band, the geometric-mean mask; docs/algorithms.md §2.10), for the
        policy-gradient term of every RL stage's loss, with their statistics (masked share, weight
        quantiles); (None, {}) without a correction. The ratio is the trainer's recomputation (the
        proximal policy) over the sampler's (the behaviour policy): decoupled PPO's IS weight."""
        c = self.config
        if c.rollout_correction == "none":
            return None, {}
        sampler = mb.require("sampler_logprobs").sampler_logprobs
        band = (c.correction_band_low, c.correction_band_high)
        return correction_weights(mb.logprobs, sampler, mask, c.rollout_correction, c.tis_cap, band)

    def optimizer_step(self, opt: Any, sched: Any, finite_loss: bool) -> bool:
        """After the minibatch's backward passes: global grad-norm clip (DeepSpeed clips in its own
        config) → step → zero_grad (spent gradients are not held through the next rollout: TRL frees
        them alike).

        A loss that was not finite on some rank (``finite_loss`` false, the same on every rank), or a
        non-finite gradient norm, is skipped and counted: no optimizer or schedule step
        (lit_rlhf/modules/health.py). The norm is computed once for the check and the clip, across
        shards under FSDP
        (:func:`lit_rlhf.runtime.strategies.sharded_grad_norm`), so every rank decides alike. Under
        DeepSpeed the gradients live in the engine: only the loss is checked there. Returns
        whether the update was applied.
        """
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lit_rlhf.runtime.strategies import sharded_grad_norm

        strategy = self.trainer.strategy
        max_norm = self.config.max_grad_norm
        applied = finite_loss
        if applied and not isinstance(strategy, DeepSpeedStrategy):
            params = [p for group in opt.param_groups for p in group["params"]]
            norm = sharded_grad_norm(params, strategy)
            applied = bool(torch.isfinite(norm))
            if applied and max_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        if applied:
            opt.step()
            sched.step()
        opt.zero_grad()  # the gradients are spent: the next rollout's peak does not hold them
        self.health.count_update(applied)
        return applied

    def max_steps_reached(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps >= 0 and self.global_step >= max_steps

    # ------------------------------------------------------------ 4. end of iteration
    @torch.no_grad()
    def update_kl_controller(self, rollout: Rollout) -> None:
        """Feed an adaptive β controller the mean sequence KL of ALL ranks' rollouts, so that β
        stays the same on every rank (a fixed β needs no input: no collective then)."""
        if not isinstance(self.kl_ctl, AdaptiveKLController) or rollout.ref_logprobs is None:
            return
        kl_seq = sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.valid_mask, self.config.kl_estimator)
        kl_sum_n = all_reduce_sum(torch.stack([kl_seq.sum(), kl_seq.new_tensor(float(kl_seq.shape[0]))]).float())
        self.kl_ctl.update(float(kl_sum_n[0] / kl_sum_n[1]), int(kl_sum_n[1]))

    def end_iteration(
        self, rollout: Rollout, stats: dict[str, Tensor], started: float, collected: float
    ) -> dict[str, Any]:
        """Count the iteration, log its statistics and timings, and return the step output the
        monitor callbacks read (raw score statistics, KL, perplexity and length are theirs)."""
        self.iteration += 1
        if self.producer is not None:  # async: the producer samples the coming rollouts with these weights
            self.producer.publish(self.iteration)
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

    # -------------------------------------------------- stage hooks: sizes of an iteration
    def responses_per_prompt(self) -> int:
        """Responses sampled per prompt (GRPO's group size G; 1 for PPO)."""
        return 1

    def num_passes(self) -> int:
        """Passes of the update over each rollout (PPO's ``ppo_epochs``, GRPO's μ)."""
        return 1

    def minibatch_rows(self, n: int) -> int:
        """Responses per optimizer step when the rollout holds ``n`` (``algo.minibatch_size``, or all)."""
        return min(self.config.minibatch_size or n, n)

    def entropy_in_loss(self) -> bool:
        """Whether the policy entropy needs a graph (an entropy term in the loss)."""
        return False

    # ====================================================================== validation
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
                agent=self.agent_loop(),
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
                    agent=self.agent_loop(),
                )
            for key, value in ev.metrics().items():
                self.log(f"val/{key}", value, batch_size=n, sync_dist=True, prog_bar=key == "greedy_accuracy")

    def on_validation_epoch_end(self) -> None:
        if self.agent is not None:  # the validation trajectories are not the next iteration's
            self.agent.take_stats()

    def on_validation_end(self) -> None:
        if self.producer is not None:  # back to the split of the asynchronous iterations
            set_num_threads(self._training_threads)

    def teardown(self, stage: str) -> None:
        """The end of a fit: the tool workers stop with the engine (:meth:`RLHFModule.teardown`)."""
        super().teardown(stage)
        if self.agent is not None:
            agent, self.agent = self.agent, None
            agent.close()
        if self.producer is not None:
            producer, self.producer = self.producer, None
            producer.close()
            set_num_threads(self._threads)

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # trainer.validate() before fit: no on_fit_start
            self.on_fit_start()
        if self.producer is not None:  # async: validation samples here, with all of the threads
            set_num_threads(self._threads)  # (the producer has at most the bound's rollouts to finish)

    # ============================================================== models and rewards
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
        """``self.scorer`` from ``reward_path`` (a frozen reward model), ``reward_fn`` or
        ``reward_fns``, and the validation-only ``self.gold_scorer``."""
        from lit_rlhf.data.tokenizers import build_tokenizer
        from lit_rlhf.models.builders import freeze, resolve_path
        from lit_rlhf.models.reward import load_reward_model
        from lit_rlhf.rollout.scorers import ModelScorer, callable_scorer, weighted_scorer

        c: RLConfig = self.config
        if c.reward_path is not None:
            self.health.reward_name = f"the reward model {c.reward_path}"
            path = resolve_path(c.reward_path)
            rm = freeze(load_reward_model(path, dtype=self.model_spec.dtype))
            rm.padding_free = c.padding_free
            self.frozen["reward"] = rm
            rm_tok = build_tokenizer(ModelSpec(name_or_path=path, kind=rm.kind))
            self.scorer = ModelScorer(rm, rm_tok, self.ensure_tokenizer(), None, c.reward_max_length)
        elif c.reward_fn is not None:
            self.health.reward_name = f"reward_fn {c.reward_fn['_target_']}"
            self.scorer = callable_scorer(c.reward_fn)
        else:
            self.health.reward_name = "reward_fns"
            self.scorer = weighted_scorer(c.reward_fns)
        if c.gold_reward_fn is not None:
            self.gold_scorer = callable_scorer(c.gold_reward_fn)

    def exportable_model(self) -> nn.Module:
        return self.actor

    def on_fit_start(self) -> None:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from lit_rlhf.data.chat import get_template
        from lit_rlhf.data.prompts import PromptDataModule
        from lit_rlhf.rollout.scorers import ModelScorer

        dm = self.trainer.datamodule
        prompts = self.prompts_per_iteration(self.config)
        if isinstance(dm, PromptDataModule) and dm.config.batch_size != prompts:
            # the step budget, the lr schedule and the progress bar count with rollout_batch_size
            raise ValueError(
                f"the prompt loader's batch ({dm.config.batch_size}) is not the {prompts} prompts of "
                f"algo.rollout_batch_size={self.config.rollout_batch_size}: build the data module with "
                "that batch size"
            )
        if self.config.micro_batch_size and isinstance(self.trainer.strategy, DeepSpeedStrategy):
            # its engine owns accumulation (gradient_accumulation_steps) and reduces on every backward
            raise ConfigError(
                "algo.micro_batch_size",
                "not with a DeepSpeed strategy, whose engine accumulates by its own gradient_accumulation_steps; "
                "set algo.micro_batch_size=null (or use ddp / fsdp)",
            )
        for m in self.frozen.values():
            m.to(self.device)
        if isinstance(self.scorer, ModelScorer) and self.scorer.template is None:
            self.scorer.template = get_template(dm.config.template if dm is not None else "plain")
        ptx_source = getattr(getattr(dm, "config", None), "ptx_source", None)
        if ptx_source and not getattr(self.config, "ptx_coef", 0.0):
            log.warning(
                "data.prompt.ptx_source=%s is set but %s: its batches are loaded and never used (set "
                "algo.ptx_coef > 0 with algo=ppo*, or drop the source)",
                ptx_source,
                "algo.ptx_coef=0" if hasattr(self.config, "ptx_coef") else "this stage has no PPO-ptx term",
            )

    def on_train_start(self) -> None:
        """Async rollouts: the prompt loader shows ``max_staleness`` batches ahead (their tickets are
        handed to the producer early, lit_rlhf/data/loader.py ``lookahead``)."""
        c = self.config.rollout
        if c.mode == "async" and c.max_staleness > 0:
            from lit_rlhf.utils.compat.lightning import combined_loader

            combined = combined_loader(self.trainer)
            loaders = combined.iterables if combined is not None else None
            loader = loaders.get("prompts") if isinstance(loaders, dict) else loaders
            if not hasattr(loader, "lookahead"):
                raise ConfigError(
                    "algo.rollout.max_staleness",
                    f"async rollouts ahead of the trainer need lit_rlhf's prompt loader; got {type(loader).__name__}",
                )
            loader.lookahead = c.max_staleness

    @classmethod
    def needs_reference(cls, config: RLConfig) -> bool:
        """Whether the run holds the frozen reference: for the KL term (β > 0), or to monitor the
        KL to the starting policy (``algo.monitor_kl``, on by default)."""
        return config.kl_coef > 0 or config.monitor_kl

    @classmethod
    def planned_models(cls, config: RLConfig) -> list[tuple[str, str, str | None]]:
        """(name, role, path or None = the model group's) of every model a run holds, for the
        memory plan (lit_rlhf/launch/memory_plan.py): the stage says what it builds."""
        out = [("actor", "trained", config.policy_path)]
        if cls.needs_reference(config):
            out.append(("reference", "frozen-ref", config.policy_path))
        if config.reward_path:
            out.append(("reward model", "frozen", config.reward_path))
        from lit_rlhf.rewards.http import shown_urls

        for i, spec in enumerate([config.reward_fn] if config.reward_fn else list(config.reward_fns or [])):
            if getattr(_locate_target(spec), "remote", False):  # served elsewhere: no memory here
                out.append((spec.get("name") or f"reward {i}", "remote", shown_urls(spec.get("urls") or "")))
        return out

    # ==================================================================== runner hooks
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
        """The prompt loader's batch follows ``algo.rollout_batch_size`` (one value, one key); an
        explicit vLLM ``max_model_len`` must hold the longest prompt and response (refused here, not
        after the engine is built)."""
        gen = config.generation
        needed = (getattr(data, "max_prompt_length", None) or 0) + gen.max_new_tokens
        if gen.engine == "vllm" and gen.vllm.max_model_len and gen.vllm.max_model_len < needed:
            raise ConfigError(
                "algo.generation.vllm.max_model_len",
                f"{gen.vllm.max_model_len} is shorter than data.prompt.max_prompt_length "
                f"({needed - gen.max_new_tokens}) + algo.generation.max_new_tokens ({gen.max_new_tokens}) = {needed}",
            )
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

    def total_updates(self) -> int:
        """Optimizer steps of the whole fit: trainer.max_steps, else batches × updates per batch."""
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        batches = self.trainer.estimated_stepping_batches  # manual optimization: counts batches
        if not math.isfinite(batches):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the lr schedule needs a length")
        return max(1, int(batches) * self.updates_per_iteration())

    # ======================================================= the interface of the callbacks
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

    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        """Optimizer steps of one RL iteration of ``batch_size`` responses (default: a full rollout)."""
        n = self.config.rollout_batch_size if batch_size is None else batch_size
        return self.num_passes() * math.ceil(n / self.minibatch_rows(n))

    def rl_state_dict(self) -> dict[str, Any]:
        """Non-parameter training state; subclasses add theirs (e.g. PPO's running reward moments)."""
        return {"iteration": self.iteration, "kl_ctl": self.kl_ctl.state_dict(), "health": self.health.state_dict()}

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.health.load_state_dict(state.get("health", {}))

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


def minibatch_indices(n: int, size: int, passes: int, generator: torch.Generator | None = None) -> Iterator[Tensor]:
    """``passes`` passes over ``range(n)``, each shuffled and cut into index tensors of ``size``
    (the last one smaller when ``size`` does not divide ``n``)."""
    for _ in range(passes):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            yield order[start : start + size]


def sum_over_micro_batches(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """A minibatch's statistics from its micro-batches': the loss terms (keys ending in ``loss``)
    are shares of the minibatch's loss, each divided by the whole minibatch's counts, so they add up;
    the other statistics are the micro-batches' own, averaged (``*_max``: the maximum)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Tensor] = {}
    for key in {k for p in parts for k in p}:
        values = torch.stack([p[key].detach().float().reshape(()) for p in parts if key in p])
        out[key] = values.sum() if key.endswith("loss") else values.max() if key.endswith("_max") else values.mean()
    return out


def mean_over_minibatches(collected: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """An iteration's statistics over its minibatches: means, except ``policy/ratio_max`` (the max)."""
    out = {k: torch.stack(v).mean() for k, v in collected.items()}
    if "policy/ratio_max" in collected:
        out["policy/ratio_max"] = torch.stack(collected["policy/ratio_max"]).max()
    return out


def has_dropout(module: nn.Module | None) -> bool:
    """Any active dropout (nn.Dropout p > 0, or a transformers config attention/hidden dropout)."""
    if module is None:
        return False
    for m in module.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        config = getattr(m, "config", None)
        keys = ("attention_dropout", "hidden_dropout", "dropout")
        if config is not None and any(getattr(config, k, 0) or 0 for k in keys):
            return True
    return False


def _locate_target(spec: Any) -> Any:
    """The factory a ``{_target_: …}`` reward names (checked importable by modules/configs.py)."""
    from hydra.utils import get_object

    return get_object(spec["_target_"])
