"""Typed, validated configs of every stage (``algo.*`` keys); defaults documented per field.

Built by ``lit_rlhf.utils.config.build_config``: a typo'd key, a wrong type or an out-of-range
value fails at start naming the key (``algo.lr: must be > 0, got -1.0``), before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
