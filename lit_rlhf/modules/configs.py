"""Typed, validated configs of every stage (``algo.*`` keys); each field's default and meaning.

Each field is declared once, in the class where it belongs: :class:`OptimConfig` (optimizer and
schedule) ← :class:`StageConfig` (+ the export) ← every stage; :class:`PolicyConfig` (the policy
a preference or RL stage trains, its forwards and its sampling) ← :class:`DPOConfig` and
:class:`RLConfig` (the reward, the KL, the clipped surrogate, the minibatches and whitening every RL
stage shares) ← :class:`PPOConfig`, :class:`CriticFreeConfig`. The classes are registered as Hydra
schemas (lit_rlhf/launch/schemas.py) that every ``lit_rlhf/conf/algo/*.yaml`` preset starts from: the
dataclass defaults are the values stages share, and each preset sets its paper's recipe for real
LMs (7B scale, docs/algorithms.md §3) over them, so ``--cfg job`` shows every key and where a
recipe number comes from (the tiny embedded-task model's values live in lit_rlhf/conf/experiment/*_tiny.yaml).

Built by ``lit_rlhf.utils.config.build_config``: a typo'd key, a wrong type or an out-of-range
value fails at start naming the key (``algo.lr: must be > 0, got -1.0``), before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lit_rlhf.core.objectives import AGGREGATIONS, CORRECTIONS, PAIR_LOSSES, POLICY_LOSSES, PairLoss, check_name
from lit_rlhf.rollout.config import GenerationConfig, RolloutModeConfig
from lit_rlhf.utils.config import check


@dataclass
class OptimConfig:
    """AdamW + warm-up + decay schedule, shared by every trainable stage."""

    lr: float = field(default=1e-4, metadata={"gt": 0.0})
    """Peak learning rate (after warm-up); PPO's is the actor's (``critic_lr`` the critic's)."""
    weight_decay: float = field(default=0.0, metadata={"ge": 0.0})
    """AdamW decoupled weight decay, on weight matrices only (never norms or biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2)."""
    eps: float = field(default=1e-8, metadata={"gt": 0.0})
    """AdamW ε."""
    optimizer: Literal["adamw", "cpu_adam"] = "adamw"
    """"cpu_adam" = DeepSpeedCPUAdam, required by ZeRO optimizer offload."""
    scheduler: Literal["constant", "linear", "cosine", "inverse_sqrt"] = "cosine"
    """lr after warm-up: constant; linear or cosine decay down to ``min_lr_ratio × lr`` at the last
    step; inverse_sqrt = lr·sqrt(w / step) after w warm-up steps (transformers' inverse_sqrt
    schedule, timescale w, or 10,000 without warm-up; ORPO's recipe)."""
    warmup_steps: int = field(default=0, metadata={"ge": 0})
    """Linear warm-up optimizer steps; > 0 takes precedence over warmup_ratio (as in transformers)."""
    warmup_ratio: float = field(default=0.0, metadata={"ge": 0.0, "le": 1.0})
    """Warm-up as a fraction of all optimizer steps (when warmup_steps is 0)."""
    min_lr_ratio: float = field(default=0.1, metadata={"ge": 0.0, "le": 1.0})
    """Final lr as a fraction of ``lr`` (linear/cosine schedules)."""

    def validate(self) -> None:
        check(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"each beta must be in [0, 1), got {self.betas}")


@dataclass
class StageConfig(OptimConfig):
    """What every stage shares: its optimization and where its trained model goes."""

    export_dir: str | None = None
    """Where the trained model (and tokenizer) is saved with ``save_pretrained`` at the end of fit,
    atomically (later stages load it by path); None = no export."""


@dataclass
class PaddingFreeConfig:
    """The switch of the stages whose causal-LM forwards can run without padding."""

    padding_free: bool = True
    """Run causal-LM forwards (policy, reference, critic, reward model) on the packed real tokens of
    their sequences, without padding (docs/architecture.md, "Padding-free forwards"); each model is
    checked against the padded forward on its first batch and keeps the padded one if they disagree.
    Encoders always run padded."""


@dataclass
class SFTConfig(StageConfig):
    """Supervised fine-tuning: token-mean NLL of the response tokens (prompt masked out). The preset
    (lit_rlhf/conf/algo/sft.yaml) is the Llama-2 SFT recipe (Touvron et al. 2023 §3.1)."""


@dataclass
class RMConfig(StageConfig, PaddingFreeConfig):
    """Pairwise reward model (docs/algorithms.md §1): Bradley–Terry + optional LM and centering terms.
    The preset (lit_rlhf/conf/algo/rm.yaml) is the Llama-2 reward-model recipe."""

    beta_rm: float = field(default=0.0, metadata={"ge": 0.0})
    """Weight of the LM loss on the chosen response (MOSS-RLHF uses 1; needs a causal LM backbone)."""
    center_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """Weight of mean[(r_w + r_l)²] (reward centering, TRL); 0 = off."""
    pooling: Literal["auto", "last", "cls", "mean"] = "auto"
    """Hidden state the head reads: auto = last non-pad token (causal LM) or mean (encoder)."""
    head_init_std: float | None = field(default=None, metadata={"gt": 0.0})
    """Std of the head's initial weights; None = 1/sqrt(hidden + 1)."""
    export_best: bool = True
    """Export the best checkpoint by validation accuracy (when checkpointing monitors it), not the last."""


def _rollout_generation() -> GenerationConfig:
    # docs/algorithms.md §3: T 0.8, top-p 0.9, repetition penalty 1.1; 256 new tokens (7B recipe)
    return GenerationConfig(max_new_tokens=256, temperature=0.8, top_p=0.9, repetition_penalty=1.1)


@dataclass
class PolicyConfig(StageConfig, PaddingFreeConfig):
    """What the stages that train a policy share (the DPO family and RL): the policy, its sampling."""

    policy_path: str | None = None
    """The SFT model to train (``save_pretrained`` folder or hub id): the policy's initial weights
    AND the frozen reference's. None = the ``model`` group's model (``model=llama7b`` names it)."""
    generation: GenerationConfig = field(default_factory=_rollout_generation)
    """Sampling settings: the RL rollouts (validation samples with them too), DPO's drift measurement."""


@dataclass
class RLConfig(PolicyConfig):
    """What every RL stage shares (PPO, the critic-free family): reward, rollout, KL, the clipped
    surrogate, minibatches and whitening."""

    reward_path: str | None = None
    """A saved reward model (algo=rm's export_dir): the frozen scorer (and, for PPO, the critic init)."""
    reward_fn: dict | None = None
    """Instead of a reward model: ``{_target_: factory}`` returning ``fn(prompts, responses, ended)
    -> list[float]``, e.g. ``lit_rlhf.data.synthetic.gold_reward_fn`` (the embedded gold reward)."""
    reward_fns: list[dict] | None = None
    """Instead: several such callables summed with weights, ``[{_target_: …, weight: 1.0, name: …}]``;
    each component is logged as ``reward/<name>`` (e.g. a verifier plus a format reward)."""
    gold_reward_fn: dict | None = None
    """Optional second reward evaluated in validation only (``val/gold_score_mean``), never trained
    on: e.g. the embedded task's gold reward, to watch the proxy being over-optimized."""
    val_pass_k: int = field(default=0, metadata={"ge": 0})
    """Verifiable tasks: validation also decodes each prompt greedily (``val/greedy_accuracy``,
    ``val/greedy_length``) and samples it k times (``val/pass@k``, ``val/mean@k``, Chen et al.
    2021; docs/rewards.md), correctness from the gold reward when set, else the reward; 0 = off."""
    val_correct_at: float = 1.0
    """A validation response counts as correct when its score reaches this (1.0: a 0/1 verifier)."""
    reward_max_length: int = field(default=1024, metadata={"ge": 8})
    """Max tokens when a reward model with its own tokenizer re-tokenizes prompt + response."""
    rollout_batch_size: int = field(default=32, metadata={"ge": 1})
    """Responses sampled per RL iteration and process (the rollout buffer; sets the prompt loader's batch)."""
    rollout: RolloutModeConfig = field(default_factory=RolloutModeConfig)
    """Synchronous or asynchronous rollouts (``algo.rollout.mode``, ``max_staleness``; docs/async.md)."""
    minibatch_size: int | None = field(default=None, metadata={"ge": 1})
    """Responses per optimizer step; None = the whole rollout (one step per pass)."""
    micro_batch_size: int | None = field(default=None, metadata={"ge": 1})
    """Responses per forward and backward within one optimizer step (gradient accumulation): each
    minibatch is cut into micro-batches of this many rows, every loss term divided by the whole
    minibatch's counts, so the step is the one pass's exactly (docs/algorithms.md §6) with the
    activations of one micro-batch. None = the whole minibatch at once. Not with DeepSpeed strategies."""
    logprobs_at_sampling_temperature: bool = False
    """False: log-probs at temperature 1 (docs/algorithms.md §2.1); True: logits / sampling temperature."""
    monitor_sampler: bool = False
    """Keep the sampler's own log-probs of its tokens and log the sampler–trainer mismatch,
    ``rollout/sampler_kl`` and ``rollout/sampler_logprob_diff_max`` (docs/algorithms.md §2.10; one
    log-softmax per decoding step). On with ``rollout_correction=tis``."""
    rollout_correction: str = "none"
    """The correction for a sampler that is not the trainer, a key of lit_rlhf/core/objectives.py
    ``CORRECTIONS`` (docs/algorithms.md §2.10): tis (= token_truncate: min(π_trainer/π_sampler, C) per
    token, Yao et al. 2025), token_mask, decoupled (the uncapped behaviour weight of decoupled PPO, Hilton
    et al. 2022: the ratio's clip is around the trainer's recomputation, the proximal policy),
    sequence_truncate, sequence_mask, icepop (band mask per token), geo_mask (a response's geometric-mean
    ratio outside the band drops it); none = no correction."""
    tis_cap: float = field(default=2.0, metadata={"gt": 0.0})
    """C of the truncate and mask corrections (Yao et al. use 2; TRL's sequence mask 3)."""
    correction_band_low: float = field(default=0.5, metadata={"ge": 0.0})
    """Lower end of the icepop and geo_mask band (IcePop: 0.5)."""
    correction_band_high: float = field(default=2.0, metadata={"gt": 0.0})
    """Upper end of the icepop and geo_mask band (IcePop: 2)."""
    max_grad_norm: float | None = field(default=1.0, metadata={"gt": 0.0})
    """Global grad-norm clip over everything trained (DeepSpeed strategies clip in their config)."""
    max_bad_iterations: int = field(default=3, metadata={"ge": 1})
    """Consecutive iterations with non-finite rewards or skipped (non-finite) updates that stop the run
    with an error naming the cause (each one alone is a counted skip)."""
    kl_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """β of the KL(π‖π_ref) term (its initial value: the KL controller owns it during training); 0 =
    no KL term (the reference is still loaded to monitor the KL unless algo.monitor_kl=false)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator (docs/algorithms.md §2.3; k3: DeepSeekMath's loss term)."""
    kl_placement: Literal["reward", "loss"] = "reward"
    """reward: −β·kl_t on every response token of the reward (PPO, REINFORCE++, ReMax; docs/algorithms.md
    §2.2, §6.1); loss: β·KL(π_θ‖π_ref) added to the policy loss (GRPO; k2/k3 only)."""
    monitor_kl: bool = True
    """With β = 0, still load the frozen reference (the starting policy) to log ``stability/kl`` and
    ``val/kl``, and so that a collapse rollback's raise of β can act. False with β = 0: no reference
    (saves its memory; the memory plan follows the switch); the KL monitors log nothing."""
    adaptive_kl: bool = False
    """Ziegler's adaptive β towards kl_target (sequence KL) over kl_horizon samples."""
    kl_target: float = field(default=6.0, metadata={"gt": 0.0})
    """Adaptive β: target sequence KL (nats per response)."""
    kl_horizon: int = field(default=10000, metadata={"ge": 1})
    """Adaptive β: samples over which β moves by at most ±20%."""
    clip_eps_low: float = field(default=0.2, metadata={"gt": 0.0, "le": 1.0})
    """Policy ratio clip below: ρ ≥ 1 − ε_low (1 = no lower bound: CISPO's weight)."""
    clip_eps_high: float = field(default=0.2, metadata={"gt": 0.0})
    """Policy ratio clip above: ρ ≤ 1 + ε_high (> ε_low = clip-higher; DAPO: 0.28)."""
    policy_loss: str = "clip"
    """The policy-gradient objective: a key of lit_rlhf/core/objectives.py ``POLICY_LOSSES`` (clip:
    PPO's clipped surrogate, docs/algorithms.md §2.6; gspo, gspo_token, cispo, gmpo: §6.3)."""
    dual_clip: float | None = field(default=None, metadata={"gt": 1.0})
    """Dual-clip constant c > 1 for negative advantages (Ye et al. 2020); None = off."""
    loss_aggregation: str = "token_mean"
    """How the policy loss (and a KL in the loss) becomes a scalar: a key of lit_rlhf/core/objectives.py
    ``AGGREGATIONS``: token_mean (PPO, DAPO), seq_mean_token_mean (GRPO), seq_sum_constant (Dr. GRPO:
    Σ / (B · max_new_tokens))."""
    loss_normalization: Literal["global", "local"] = "global"
    """global: ``loss_aggregation``'s count (tokens, or responses) is the whole minibatch's over all
    ranks, so the averaged gradient does not depend on how the batch is sharded (docs/algorithms.md §6);
    local: each rank's own count (what per-rank code computes; for comparison). Alone: the same."""
    whiten_advantages: bool = False
    """Whiten the advantages to mean 0, std 1 over the whole rollout of ALL ranks before the
    minibatches (PPO's GAE advantages, REINFORCE++'s global normalization); false = as computed."""
    fuse_first_forward: bool = True
    """With one pass over one minibatch (and no dropout), take the old log-probs (and PPO's old
    values) from the first training forward instead of separate rollout passes: exact, and cheaper."""
    environment: dict | None = None
    """Multi-turn rollouts (docs/agents.md): ``{_target_: mypkg.envs.MyEnv, **kwargs}``, a class built
    once per trajectory; its public methods are tools the policy calls with ``<tool_call>`` blocks,
    or its ``step(text)`` answers every turn. ``algo.generation.max_new_tokens`` is then the budget of
    a whole trajectory (the policy's and the environment's tokens). None = one turn."""
    max_turns: int = field(default=8, metadata={"ge": 1})
    """Policy turns per trajectory at most (the calls of the last one are not run)."""
    max_tool_response_tokens: int | None = field(default=256, metadata={"ge": 1})
    """A tool reply (or a game's observation) longer than this many tokens is cut (counted in
    ``agent/tool_response_truncated``); None = never cut."""
    tool_response_truncation: Literal["keep_start", "keep_end"] = "keep_start"
    """Which part of a cut reply is kept: its first tokens (keep_start) or its last (keep_end)."""
    tool_timeout_s: float = field(default=30.0, metadata={"gt": 0.0})
    """A tool call (or a game's step) that has not returned this long after it started is answered
    with a timeout error (counted); its thread is left to finish, its result unused."""
    tool_workers: int = field(default=32, metadata={"ge": 1})
    """Tool calls run at once (a turn's calls of every trajectory run concurrently)."""
    tool_parser: dict | None = None
    """``{_target_: factory}`` returning ``parse(text) -> list[ToolCall]`` (lit_rlhf/rollout/environment.py);
    None = the ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` form."""

    def validate(self) -> None:
        super().validate()
        rewards = [k for k in ("reward_path", "reward_fn", "reward_fns") if getattr(self, k)]
        check(
            len(rewards) == 1,
            "reward_path",
            "set exactly one of algo.reward_path (a saved reward model), algo.reward_fn (a {_target_: …} callable) "
            f"and algo.reward_fns (weighted callables); got {rewards or 'none'}",
        )
        check_reward_specs(self.reward_fn, self.reward_fns, self.gold_reward_fn)
        for key, what in (
            ("environment", "an environment class, built once per trajectory"),
            ("tool_parser", "a factory returning the tool-call parser"),
        ):
            if getattr(self, key) is not None:
                _check_reward_spec(key, getattr(self, key), (), what)
        check(
            self.correction_band_low < self.correction_band_high,
            "correction_band_high",
            f"must be > algo.correction_band_low ({self.correction_band_low}), got {self.correction_band_high}",
        )
        for key, table in (
            ("policy_loss", POLICY_LOSSES),
            ("loss_aggregation", AGGREGATIONS),
            ("rollout_correction", CORRECTIONS),
        ):
            problem = check_name(table, getattr(self, key))
            check(problem is None, key, problem or "")
        self.validate_async()
        objective = POLICY_LOSSES.get(self.policy_loss)
        check(
            self.clip_eps_high >= self.clip_eps_low or (objective is not None and not objective.ordered_clip),
            "clip_eps_high",
            f"must be >= algo.clip_eps_low ({self.clip_eps_low}), got {self.clip_eps_high}",
        )
        check(
            self.dual_clip is None or objective is None or objective.dual_clip,
            "dual_clip",
            f"algo.policy_loss={self.policy_loss} has no dual clip: set algo.dual_clip=null",
        )
        check(
            not (self.kl_placement == "loss" and self.kl_estimator == "k1" and self.kl_coef > 0),
            "kl_estimator",
            "k1 in the loss has zero expected gradient on-policy (it does not pull towards the "
            "reference): use k2 or k3 with algo.kl_placement=loss, or kl_placement=reward",
        )

    def validate_async(self) -> None:
        """``algo.rollout.mode=async`` (docs/async.md): a correction named, a vLLM engine the producer
        can hold alone, a merge the bound can fill."""
        if self.rollout.mode == "sync":
            return
        check(
            self.rollout_correction != "none",
            "rollout_correction",
            "algo.rollout.mode=async trains on rollouts sampled by older weights: name the correction, e.g. "
            "algo.rollout_correction=decoupled (the behaviour weight of decoupled PPO) or tis (docs/async.md)",
        )
        check(
            self.generation.engine != "vllm" or self.generation.vllm.tensor_parallel_size == 1,
            "generation.vllm.tensor_parallel_size",
            "an async rollout producer samples alone, on its rank's device: its vLLM engine has no ranks to split "
            "the model over; use tensor_parallel_size=1 or algo.rollout.mode=sync",
        )
        check(
            self.rollout.merge_rollouts <= self.rollout.max_staleness + 1,
            "rollout.merge_rollouts",
            f"the producer has at most algo.rollout.max_staleness + 1 = {self.rollout.max_staleness + 1} rollouts "
            f"admitted at once to merge; got {self.rollout.merge_rollouts}",
        )


REWARD_FNS_OWN_KEYS = ("weight", "name")
"""Keys of an ``algo.reward_fns`` item that the stage reads (modules/rl.py) and the factory never gets."""


def check_reward_specs(reward_fn: dict | None, reward_fns: list[dict] | None, gold_reward_fn: dict | None) -> None:
    """Each ``{_target_: factory, **kwargs}`` of ``reward_fn``, ``gold_reward_fn`` and ``reward_fns``
    (with an item's ``weight`` and ``name``): a ConfigError naming ``<key>.<field>``, e.g.
    ``reward_fns[1].weight``, before anything is built. The factory is imported and the keyword
    arguments checked against its signature: a typo'd path or argument fails here, naming its key,
    not in Hydra's instantiate when the stage builds. Names must differ: each component is logged
    as ``reward/<name>`` (default: the factory's name)."""
    specs = [("reward_fn", reward_fn, ()), ("gold_reward_fn", gold_reward_fn, ())]
    specs += [(f"reward_fns[{i}]", v, REWARD_FNS_OWN_KEYS) for i, v in enumerate(reward_fns or [])]
    for key, spec, own in specs:
        if spec is not None:
            _check_reward_spec(key, spec, own)
    names: dict[str, int] = {}
    for i, spec in enumerate(reward_fns or []):
        name = spec.get("name") or spec["_target_"].rsplit(".", 1)[-1]
        check(
            name not in names,
            f"reward_fns[{i}].name",
            f"{name!r} already names reward_fns[{names.get(name)}] (components are logged as reward/<name>): "
            "set distinct names",
        )
        names[name] = i


def _check_reward_spec(
    key: str, spec: dict, own: tuple[str, ...], what: str = "a factory returning the reward callable"
) -> None:
    """One ``{_target_: …}`` mapping; ``own``: the keys the stage reads itself (not the factory's);
    ``what``: what the target must be, for the messages."""
    import math
    from collections.abc import Mapping

    from lit_rlhf.utils.config import check_call_arguments

    check(
        isinstance(spec, Mapping),
        key,
        f"must be a mapping with a _target_ ({what}), got {spec!r}",
    )
    target = spec.get("_target_")
    check(
        isinstance(target, str) and len(target.split(".")) > 1 and all(p.isidentifier() for p in target.split(".")),
        f"{key}._target_",
        f"must be the dotted path of {what} (e.g. lit_rlhf.data.synthetic.gold_reward_fn), got {target!r}",
    )
    if "weight" in own and spec.get("weight") is not None:
        w = spec["weight"]
        check(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w),
            f"{key}.weight",
            f"must be a finite number, got {w!r}",
        )
    if "name" in own and spec.get("name") is not None:
        check(
            isinstance(spec["name"], str) and spec["name"].strip() != "",
            f"{key}.name",
            f"must be a non-empty string, got {spec['name']!r}",
        )
    factory = _import_target(target, f"{key}._target_", what)
    kwargs = {
        k: None if isinstance(v, Mapping) and "_target_" in v else v  # nested instantiation: names only
        for k, v in spec.items()
        if not k.startswith("_") and k not in own
    }
    check_call_arguments(factory, kwargs, key)


def _import_target(path: str, key: str, what: str = "a factory returning the reward callable") -> object:
    """The object at dotted ``path`` (module, then attributes); a ConfigError naming ``key`` if it
    cannot be imported or is not callable."""
    import importlib

    from lit_rlhf.utils.config import ConfigError

    module, attrs = path, []
    try:
        while True:
            try:
                obj = importlib.import_module(module)
                break
            except ModuleNotFoundError as err:  # not a module: one attribute further (unless a dependency is missing)
                if "." not in module or not (err.name == module or module.startswith(f"{err.name}.")):
                    raise
                module, attr = module.rsplit(".", 1)
                attrs.insert(0, attr)
        for attr in attrs:
            obj = getattr(obj, attr)
    except Exception as err:  # the user's module may raise anything while importing
        raise ConfigError(key, f"cannot import {path!r}: {type(err).__name__}: {' '.join(str(err).split())}") from None
    check(callable(obj), key, f"{path!r} is not callable ({what})")
    return obj


@dataclass
class PPOConfig(RLConfig):
    """PPO / PPO-max for language models (docs/algorithms.md §2–§3). Every switch is a key;
    lit_rlhf/conf/algo/ppo.yaml is vanilla PPO with the MOSS-RLHF 7B recipe,
    lit_rlhf/conf/algo/{ppo_max,ppo_moss_release}.yaml the switches of PPO-max over it."""

    # ---- models
    critic_path: str | None = None
    """Critic init; None = reward_path when it is a causal-LM reward model, else policy_path (fresh head)."""
    # ---- optimization
    critic_lr: float = field(default=1.65e-6, metadata={"gt": 0.0})
    """Critic learning rate (MOSS-RLHF 7B: 1.65e-6); same warm-up/decay schedule as the actor's (``lr``)."""
    ppo_epochs: int = field(default=1, metadata={"ge": 1})
    """Passes over the rollout buffer per RL iteration."""
    critic_warmup_steps: int = field(default=0, metadata={"ge": 0})
    """First N RL iterations update only the critic (actor lr 0)."""
    # ---- reward shaping
    score_norm: Literal["none", "scale", "normalize"] = "none"
    """Score reparameterization with running moments: r/σ (scale) or (r − μ)/σ (normalize)."""
    score_clip: float | None = field(default=None, metadata={"gt": 0.0})
    """Clip the (reparameterized) score to ±δ; None = no clip."""
    missing_eos_penalty: float | None = field(default=None, metadata={"ge": 0.0})
    """Subtract this from the score of responses truncated without EOS; None = no penalty."""
    # ---- advantages
    gamma: float = field(default=1.0, metadata={"ge": 0.0, "le": 1.0})
    """Discount γ of GAE."""
    lam: float = field(default=0.95, metadata={"ge": 0.0, "le": 1.0})
    """GAE λ (bias/variance trade-off of the advantage)."""
    advantage_clip: float | None = field(default=None, metadata={"gt": 0.0})
    """Clip advantages to ±a after whitening; None = no clip."""
    # ---- losses
    value_clip: float | None = field(default=0.2, metadata={"gt": 0.0})
    """Value clip ε_v around the rollout-time values; None = unclipped value loss."""
    vf_coef: float = field(default=1.0, metadata={"ge": 0.0})
    """Weight of the value loss in the summed actor + critic loss."""
    entropy_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """Entropy bonus −c·H (0 = off)."""
    entropy_target: float | None = field(default=None, metadata={"ge": 0.0})
    """MOSS-RLHF's form instead of the bonus: c·|H − target| (fragile; off by default). Its |mean H −
    target| is each rank's own minibatch's (it is not linear in the tokens, so it cannot be split
    over micro-batches: not with ``micro_batch_size``)."""
    ptx_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """PPO-ptx: weight of the LM loss on ``data.prompt.ptx_source`` batches (0 = off)."""

    def validate(self) -> None:
        super().validate()
        objective = POLICY_LOSSES.get(self.policy_loss)
        check(
            objective is None or not objective.per_response,
            "policy_loss",
            f"{self.policy_loss} reads one advantage per response; PPO's GAE gives one per token "
            f"(use {', '.join(k for k, v in POLICY_LOSSES.items() if not v.per_response)})",
        )
        check(
            self.entropy_target is None or not self.entropy_coef or self.micro_batch_size is None,
            "micro_batch_size",
            "algo.entropy_target's |mean H − target| is of the whole minibatch and cannot be split into "
            "micro-batches: set algo.micro_batch_size=null or algo.entropy_target=null",
        )


@dataclass
class DPOConfig(PolicyConfig):
    """Direct preference optimization and its family (docs/algorithms.md §5): DPO (sigmoid), cDPO
    (label smoothing), IPO, and the reference-free SimPO (§5.1) and ORPO (§5.2) and the unpaired KTO
    (§5.3), each a ``loss_type`` of the one module (the table of pair losses: lit_rlhf/core/losses.py
    ``PAIR_LOSSES``). lit_rlhf/conf/algo/dpo.yaml is the DPO paper's recipe (Rafailov et al. 2023 App. B);
    lit_rlhf/conf/algo/{simpo,orpo,kto}.yaml set their papers' recipes."""

    reference_path: str | None = None
    """The frozen reference π_ref; None = the policy's starting weights (the usual choice). SimPO and
    ORPO have none (setting it is an error)."""
    beta: float = field(default=0.1, metadata={"gt": 0.0})
    """β: strength of the implicit KL constraint (sigmoid, KTO) / the target margin 1/(2β) (IPO) / the
    scale of the average-log-prob reward (SimPO) / ORPO's λ, the weight of the odds-ratio term
    (TRL's ORPOConfig.beta; docs/algorithms.md §5.2)."""
    loss_type: str = "sigmoid"
    """A key of lit_rlhf/core/objectives.py ``PAIR_LOSSES``: sigmoid = DPO (and cDPO with
    label_smoothing > 0); ipo = IPO's squared loss; simpo = SimPO (§5.1), orpo = ORPO (§5.2):
    reference-free, no reference model is built; kto = KTO (§5.3): unpaired desirable/undesirable
    examples (pairs are split; sets data.preference.unpaired)."""
    label_smoothing: float = field(default=0.0, metadata={"ge": 0.0, "lt": 0.5})
    """cDPO / SimPO: the assumed probability that a preference label is flipped (0 = the plain loss)."""
    gamma_beta_ratio: float = field(default=0.5, metadata={"ge": 0.0})
    """SimPO: the target reward margin as γ/β (the margin is γ = β·gamma_beta_ratio). 0.5: the SimPO
    authors' Llama-3-8B-Base recipe (princeton-nlp/SimPO training_configs/llama-3-8b-base-simpo.yaml)."""
    desirable_weight: float = field(default=1.0, metadata={"gt": 0.0})
    """KTO: λ_D, the weight of desirable examples' losses. The KTO paper keeps λ_D·n_D / (λ_U·n_U)
    in [1, 4/3] for n_D desirable and n_U undesirable examples (1 for pairs split in two)."""
    undesirable_weight: float = field(default=1.0, metadata={"gt": 0.0})
    """KTO: λ_U, the weight of undesirable examples' losses."""
    precompute_ref_logprobs: bool = False
    """Score every pair with the reference once before training (cached next to the run) and keep
    no reference model in memory while training (it is loaded again only to measure drift)."""
    ref_cache: str | None = None
    """File of the precomputed reference log-probs; None = <run dir>/ref_logprobs.pt. Reused when
    its fingerprint (reference, tokenized pairs) matches."""
    drift_prompts: int = field(default=64, metadata={"ge": 0})
    """Held-out prompts (from the validation pairs) sampled at every validation to measure drift:
    stability/kl to the reference, perplexity, response length (0 = off)."""

    @property
    def pair_loss(self) -> PairLoss:
        """The ``PAIR_LOSSES`` entry of ``loss_type``: its function and what it reads."""
        return PAIR_LOSSES[self.loss_type]

    @property
    def reference_free(self) -> bool:
        """No reference model at all (SimPO, ORPO: docs/algorithms.md §5.1, §5.2)."""
        return not self.pair_loss.reference

    def validate(self) -> None:
        super().validate()
        problem = check_name(PAIR_LOSSES, self.loss_type)
        check(problem is None, "loss_type", problem or "")
        smoothed = [k for k, v in PAIR_LOSSES.items() if "label_smoothing" in v.params]
        check(
            self.label_smoothing == 0.0 or self.loss_type in smoothed,
            "label_smoothing",
            f"applies to the {' and '.join(smoothed)} losses only; got loss_type={self.loss_type!r}",
        )
        for key in ("reference_path", "precompute_ref_logprobs"):
            check(
                not (self.reference_free and getattr(self, key)),
                key,
                f"loss_type={self.loss_type!r} is reference-free (no reference model): unset algo.{key}",
            )


@dataclass
class CriticFreeConfig(RLConfig):
    """Critic-free RL (docs/algorithms.md §6): GRPO; DAPO, Dr. GRPO, RLOO, REINFORCE++ (and its
    group-baseline variant) and ReMax are presets of it. lit_rlhf/conf/algo/grpo.yaml is GRPO as in
    DeepSeekMath (β 0.04 with k3 in the loss, lr 1e-6, per-sequence mean then batch mean, advantages
    scaled by the group std) with TRL's group size 8."""

    num_generations: int = field(default=8, metadata={"ge": 1})
    """G: responses sampled per prompt (the group). algo.rollout_batch_size counts responses. 1 only
    with a baseline that needs no group (advantage_baseline greedy or none: REINFORCE++, ReMax)."""
    num_iterations: int = field(default=1, metadata={"ge": 1})
    """μ: passes over each rollout (> 1: the old log-probs, taken at rollout, matter)."""
    scale_rewards: bool = True
    """Divide the group-relative advantage by the group's std (+1e-4); false for Dr. GRPO and RLOO."""
    advantage_baseline: Literal["mean", "leave_one_out", "greedy", "none"] = "mean"
    """What each response's score is compared with: the group's mean (GRPO, REINFORCE++-baseline), the
    mean of the OTHER responses (RLOO), the score of the greedy response to the same prompt (ReMax:
    one extra greedy response per prompt, scored, never trained on), or nothing (REINFORCE++)."""
    overlong_buffer: int | None = field(default=None, metadata={"ge": 1})
    """DAPO's soft overlong punishment: the last L_c tokens before overlong_max_length cost up to −1; None = off."""
    overlong_max_length: int | None = field(default=None, metadata={"ge": 1})
    """L_max of the punishment; None = algo.generation.max_new_tokens."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full."""
    max_resample_rounds: int = field(default=4, metadata={"ge": 0})
    """Dynamic sampling: extra prompt batches per iteration at most; then train on the groups kept."""

    def validate(self) -> None:
        super().validate()
        grouped = self.advantage_baseline in ("mean", "leave_one_out")
        check(
            self.num_generations >= 2 or not grouped,
            "num_generations",
            f"GRPO compares responses within a group: needs >= 2, got {self.num_generations} (with "
            f"algo.advantage_baseline={self.advantage_baseline}; greedy or none need no group)",
        )
        check(
            not self.scale_rewards or grouped,
            "scale_rewards",
            f"divides by the group's reward std: needs algo.advantage_baseline=mean or leave_one_out, got "
            f"{self.advantage_baseline}; set algo.scale_rewards=false",
        )
        check(
            not self.dynamic_sampling or self.num_generations >= 2,
            "dynamic_sampling",
            "drops groups whose rewards are all equal: needs algo.num_generations >= 2",
        )
        check(
            self.rollout_batch_size % self.num_generations == 0,
            "rollout_batch_size",
            f"{self.rollout_batch_size} responses do not split into groups of algo.num_generations="
            f"{self.num_generations}: make algo.rollout_batch_size a multiple of it",
        )
        check(
            self.overlong_buffer is None
            or self.overlong_buffer <= (self.overlong_max_length or self.generation.max_new_tokens),
            "overlong_buffer",
            "must not exceed the overlong max length (algo.overlong_max_length or algo.generation.max_new_tokens)",
        )


GRPOConfig = CriticFreeConfig
"""The former name of :class:`CriticFreeConfig`."""
