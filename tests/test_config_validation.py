"""Typed configs: unknown keys, wrong types, ranges and choices fail naming the key."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
from omegaconf import OmegaConf

from lit_rlhf.modules.configs import SFTConfig
from lit_rlhf.utils.config import ConfigError, build_config, check


@dataclass
class Inner:
    width: int = field(default=4, metadata={"ge": 1})


@dataclass
class Outer:
    lr: float = field(default=1e-3, metadata={"gt": 0.0})
    mode: Literal["a", "b"] = "a"
    name: str | None = None
    flag: bool = False
    inner: Inner = field(default_factory=Inner)
    lo: float = 0.1
    hi: float = 0.2

    def validate(self):
        check(self.hi >= self.lo, "hi", f"must be >= lo ({self.lo}), got {self.hi}")


def test_valid_values_and_int_widening():
    cfg = build_config(Outer, OmegaConf.create({"_target_": "x.Y", "lr": 1, "inner": {"width": 8}}), "algo")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.inner.width == 8


def test_unknown_key_suggests_and_lists():
    with pytest.raises(ConfigError) as err:
        build_config(Outer, {"lrr": 1.0}, "algo")
    msg = str(err.value)
    assert msg.startswith("algo.lrr: unknown key for Outer.")
    assert "Did you mean 'lr'?" in msg and "Allowed keys: flag, hi, inner, lo, lr, mode, name" in msg


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"lr": -1.0}, "algo.lr: must be > 0.0, got -1.0"),
        ({"lr": "fast"}, "algo.lr: expected a number, got 'fast'"),
        ({"mode": "c"}, "algo.mode: must be one of ['a', 'b'], got 'c'"),
        ({"flag": "yes"}, "algo.flag: expected true or false, got 'yes'"),
        ({"name": 3}, "algo.name: expected a string, got 3"),
        ({"inner": {"width": 0}}, "algo.inner.width: must be >= 1, got 0"),
        ({"inner": {"depth": 1}}, "algo.inner.depth: unknown key for Inner."),
        ({"lo": 0.5, "hi": 0.2}, "algo.hi: must be >= lo (0.5), got 0.2"),
    ],
)
def test_bad_values_name_the_key(values, expected):
    with pytest.raises(ConfigError) as err:
        build_config(Outer, values, "algo")
    assert str(err.value).startswith(expected)


def test_sft_config_cross_field_checks():
    with pytest.raises(ConfigError, match=r"algo.betas: each beta must be in \[0, 1\)"):
        build_config(SFTConfig, {"betas": [0.9, 1.5]}, "algo")
    assert build_config(SFTConfig, {"betas": [0.8, 0.9]}, "algo").betas == (0.8, 0.9)


def test_warmup_steps_take_precedence_over_the_presets_ratio():
    """The presets carry a warm-up ratio; setting warmup_steps must not conflict with it."""
    from lit_rlhf.modules.sft import SFTModule

    m = SFTModule(build_config(SFTConfig, {"warmup_steps": 10, "lr": 1.0}, "algo"))
    assert m.config.warmup_ratio == 0.03  # the preset's ratio is still there ...
    assert [m.lr_factor(s, 1000) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # ... the steps win


def test_partial_nested_mapping_keeps_the_fields_own_defaults():
    """algo.generation={max_new_tokens: 8} changes one key of PPO's rollout sampling, not the rest
    (the nested class's neutral defaults would sample at T=1 without top-p)."""
    from lit_rlhf.modules.configs import PPOConfig

    gen = build_config(PPOConfig, {"reward_path": "/rm", "generation": {"max_new_tokens": 8}}, "algo").generation
    assert (gen.max_new_tokens, gen.temperature, gen.top_p, gen.repetition_penalty) == (8, 0.8, 0.9, 1.1)


def test_k1_in_the_loss_is_refused():
    from lit_rlhf.modules.configs import PPOConfig

    with pytest.raises(ConfigError, match="algo.kl_estimator: k1 in the loss has zero expected gradient"):
        build_config(PPOConfig, {"reward_path": "/rm", "kl_coef": 0.1, "kl_placement": "loss"}, "algo")
    assert build_config(PPOConfig, {"reward_path": "/rm", "kl_coef": 0.1, "kl_placement": "loss",
                                    "kl_estimator": "k3"}, "algo").kl_estimator == "k3"  # fmt: skip
