"""Typed, validated configs of every stage (``algo.*`` keys); defaults documented per field.

Built by ``lit_rlhf.utils.config.build_config``: a typo'd key, a wrong type or an out-of-range
value fails at start naming the key (``algo.lr: must be > 0, got -1.0``), before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lit_rlhf.rollout.generate import GenerationConfig
from lit_rlhf.utils.config import check


@dataclass
class OptimConfig:
    """AdamW + warm-up + decay schedule, shared by every trainable stage."""

    lr: float = field(default=1e-4, metadata={"gt": 0.0})
    weight_decay: float = field(default=0.0, metadata={"ge": 0.0})
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = field(default=1e-8, metadata={"gt": 0.0})
    optimizer: Literal["adamw", "cpu_adam"] = "adamw"
    """"cpu_adam" = DeepSpeedCPUAdam, required by ZeRO optimizer offload."""
    scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    """Decay after warm-up, down to ``min_lr_ratio × lr`` at the last step."""
    warmup_steps: int = field(default=0, metadata={"ge": 0})
    """Linear warm-up optimizer steps (exclusive with warmup_ratio)."""
    warmup_ratio: float = field(default=0.0, metadata={"ge": 0.0, "le": 1.0})
    """Warm-up as a fraction of all optimizer steps (exclusive with warmup_steps)."""
    min_lr_ratio: float = field(default=0.1, metadata={"ge": 0.0, "le": 1.0})

    def validate(self) -> None:
        check(
            not (self.warmup_steps and self.warmup_ratio),
            "warmup_ratio",
            "set either warmup_steps or warmup_ratio, not both",
        )
        check(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"each beta must be in [0, 1), got {self.betas}")


@dataclass
class SFTConfig(OptimConfig):
    """Supervised fine-tuning: token-mean NLL of the response tokens (prompt masked out)."""

    lr: float = field(default=3e-3, metadata={"gt": 0.0})
    export_dir: str | None = None
    """Where the trained model and tokenizer are saved with ``save_pretrained`` at the end of
    fit (later stages load it by path); None = no export."""


@dataclass
class RMConfig(OptimConfig):
    """Pairwise reward model (ALGORITHMS §1): Bradley–Terry + optional LM and centering terms."""

    lr: float = field(default=1e-3, metadata={"gt": 0.0})
    beta_rm: float = field(default=0.0, metadata={"ge": 0.0})
    """Weight of the LM loss on the chosen response (MOSS-RLHF uses 1; needs a causal LM backbone)."""
    center_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """Weight of mean[(r_w + r_l)²] (reward centering, TRL); 0 = off."""
    pooling: Literal["auto", "last", "cls", "mean"] = "auto"
    """Hidden state the head reads: auto = last non-pad token (causal LM) or mean (encoder)."""
    head_init_std: float | None = field(default=None, metadata={"gt": 0.0})
    """Std of the head's initial weights; None = 1/sqrt(hidden + 1)."""
    export_dir: str | None = None
    """``save_pretrained`` folder of the trained reward model (backbone + head + reward_config.json)."""
    export_best: bool = True
    """Export the best checkpoint by validation accuracy (when checkpointing monitors it), not the last."""


@dataclass
class PPOConfig(OptimConfig):
    """PPO / PPO-max for language models (ALGORITHMS §2–§3). Every switch is a key; presets in
    conf/algo/{ppo,ppo_max,ppo_moss_release}.yaml only set values."""

    # ---- models
    policy_path: str = ""
    """The SFT model (``save_pretrained`` folder or hub id): actor init AND frozen reference."""
    reward_path: str | None = None
    """A saved reward model (algo=rm's export_dir): frozen scorer and, by default, critic init."""
    reward_fn: dict | None = None
    """Instead of a reward model: ``{_target_: factory}`` returning ``fn(prompts, responses, ended)
    -> list[float]``, e.g. ``lit_rlhf.data.synthetic.gold_reward_fn`` (the embedded gold reward)."""
    gold_reward_fn: dict | None = None
    """Optional second reward evaluated in validation only (``val/gold_score_mean``), never trained
    on: e.g. the embedded task's gold reward, to watch the proxy being over-optimized."""
    critic_path: str | None = None
    """Critic init; None = reward_path when it is a causal-LM reward model, else policy_path (fresh head)."""
    reward_max_length: int = field(default=512, metadata={"ge": 8})
    """Max tokens when a reward model with its own tokenizer re-tokenizes prompt + response."""
    # ---- optimization
    lr: float = field(default=5e-7, metadata={"gt": 0.0})
    """Actor learning rate."""
    critic_lr: float = field(default=1.65e-6, metadata={"gt": 0.0})
    ppo_epochs: int = field(default=1, metadata={"ge": 1})
    minibatch_size: int = field(default=4, metadata={"ge": 1})
    """Rollouts per minibatch update (the rollout batch is data.prompt.batch_size)."""
    max_grad_norm: float | None = field(default=1.0, metadata={"gt": 0.0})
    """Global grad-norm clip over actor and critic (DeepSpeed strategies clip in their config)."""
    fuse_first_forward: bool = True
    """With 1 epoch over 1 minibatch (and no dropout), take log π_old and V_old from the first
    training forward instead of separate rollout passes: exact, and two forwards cheaper."""
    critic_warmup_steps: int = field(default=0, metadata={"ge": 0})
    """First N RL iterations update only the critic (actor frozen)."""
    # ---- rollout
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    logprobs_at_sampling_temperature: bool = False
    """False: log-probs at temperature 1 (ALGORITHMS §2); True: divide logits by the sampling temperature."""
    # ---- reward shaping
    score_norm: Literal["none", "scale", "normalize"] = "none"
    """Score reparameterization with running moments: r/σ (scale) or (r − μ)/σ (normalize)."""
    score_clip: float | None = field(default=None, metadata={"gt": 0.0})
    """Clip the (reparameterized) score to ±δ."""
    missing_eos_penalty: float | None = field(default=None, metadata={"ge": 0.0})
    """Subtract this from the score of responses truncated without EOS."""
    kl_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """β; 0 = no KL term (the reference is still scored for the stability metrics)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_placement: Literal["reward", "loss"] = "reward"
    """In the per-token reward (−β·kl_t, default) or in the policy loss (β · token-mean kl)."""
    adaptive_kl: bool = False
    """Ziegler's adaptive β towards kl_target (sequence KL) over kl_horizon samples."""
    kl_target: float = field(default=6.0, metadata={"gt": 0.0})
    kl_horizon: int = field(default=10000, metadata={"ge": 1})
    # ---- advantages
    gamma: float = field(default=1.0, metadata={"ge": 0.0, "le": 1.0})
    lam: float = field(default=0.95, metadata={"ge": 0.0, "le": 1.0})
    whiten_advantages: bool = True
    """Whiten advantages over the whole rollout buffer (all ranks) before the minibatches."""
    advantage_clip: float | None = field(default=None, metadata={"gt": 0.0})
    # ---- losses
    clip_eps_low: float = field(default=0.2, metadata={"gt": 0.0, "lt": 1.0})
    clip_eps_high: float = field(default=0.2, metadata={"gt": 0.0})
    dual_clip: float | None = field(default=None, metadata={"gt": 1.0})
    value_clip: float | None = field(default=0.2, metadata={"gt": 0.0})
    vf_coef: float = field(default=1.0, metadata={"ge": 0.0})
    entropy_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """Entropy bonus −c·H (0 = off)."""
    entropy_target: float | None = field(default=None, metadata={"ge": 0.0})
    """MOSS-RLHF's form instead of the bonus: c·|H − target| (fragile; off by default)."""
    ptx_coef: float = field(default=0.0, metadata={"ge": 0.0})
    """PPO-ptx: weight of the LM loss on ``data.prompt.ptx_source`` batches (0 = off)."""
    export_dir: str | None = None
    """``save_pretrained`` folder of the final actor."""

    def validate(self) -> None:
        super().validate()
        check(bool(self.policy_path), "policy_path", "required: the SFT model folder (algo=sft's export_dir) or a hub id")
        check(
            (self.reward_path is None) != (self.reward_fn is None),
            "reward_path",
            "set exactly one of algo.reward_path (a saved reward model) and algo.reward_fn (a {_target_: …} callable)",
        )
        check(
            self.clip_eps_high >= self.clip_eps_low,
            "clip_eps_high",
            f"must be >= algo.clip_eps_low ({self.clip_eps_low}), got {self.clip_eps_high}",
        )
        for key in ("reward_fn", "gold_reward_fn"):
            check(
                getattr(self, key) is None or "_target_" in getattr(self, key),
                key,
                "must be a mapping with a _target_ (a factory returning the reward callable)",
            )
