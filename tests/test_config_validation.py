"""Typed configs: unknown keys, wrong types, ranges and choices fail naming the key."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
from omegaconf import OmegaConf

from lit_rlhf.modules.configs import SFTConfig
from lit_rlhf.utils.config import ConfigError, build_config, check
from tests.helpers.presets import preset


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

    m = SFTModule(build_config(SFTConfig, preset("sft", warmup_steps=10, lr=1.0), "algo"))
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
    assert (
        build_config(
            PPOConfig, {"reward_path": "/rm", "kl_coef": 0.1, "kl_placement": "loss", "kl_estimator": "k3"}, "algo"
        ).kl_estimator
        == "k3"
    )


GOLD = "lit_rlhf.data.synthetic.gold_reward_fn"


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"reward_fns": [{"_target_": GOLD}, 3]}, "algo.reward_fns[1]: expected a mapping, got 3"),
        ({"reward_fns": [{"_target_": GOLD}, {"weight": 1.0}]}, "algo.reward_fns[1]._target_: must be the dotted path"),
        ({"reward_fns": [{"_target_": "gold_reward_fn"}]}, "algo.reward_fns[0]._target_: must be the dotted path"),
        ({"reward_fns": [{"_target_": 3}]}, "algo.reward_fns[0]._target_: must be the dotted path"),
        (
            {"reward_fns": [{"_target_": GOLD, "weight": "heavy"}]},
            "algo.reward_fns[0].weight: must be a finite number, got 'heavy'",
        ),
        (
            {"reward_fns": [{"_target_": GOLD, "weight": float("inf")}]},
            "algo.reward_fns[0].weight: must be a finite number, got inf",
        ),
        (
            {"reward_fns": [{"_target_": GOLD, "weight": True}]},
            "algo.reward_fns[0].weight: must be a finite number, got True",
        ),
        ({"reward_fns": [{"_target_": GOLD, "name": 3}]}, "algo.reward_fns[0].name: must be a non-empty string, got 3"),
        # two components would both be logged as reward/gold_reward_fn (the default name: the factory's)
        (
            {"reward_fns": [{"_target_": GOLD}, {"_target_": GOLD, "weight": 0.5}]},
            "algo.reward_fns[1].name: 'gold_reward_fn' already names reward_fns[0]",
        ),
        (
            {
                "reward_fns": [
                    {"_target_": GOLD, "name": "a"},
                    {"_target_": GOLD, "name": "b"},
                    {"_target_": GOLD, "name": "a"},
                ]
            },
            "algo.reward_fns[2].name: 'a' already names reward_fns[0]",
        ),
        (
            {"reward_fns": [{"_target_": "lit_rlhf.data.synthetic.gold_reward_fun"}]},
            "algo.reward_fns[0]._target_: cannot import 'lit_rlhf.data.synthetic.gold_reward_fun': AttributeError",
        ),
        (
            {"reward_fns": [{"_target_": "no_such_package.fn"}]},
            "algo.reward_fns[0]._target_: cannot import 'no_such_package.fn': "
            "ModuleNotFoundError: No module named 'no_such_package'",
        ),
        ({"reward_fns": [{"_target_": "math.pi"}]}, "algo.reward_fns[0]._target_: 'math.pi' is not callable"),
        (
            {"reward_fns": [{"_target_": GOLD, "task_confg": {}}]},
            "algo.reward_fns[0].task_confg: unknown argument of gold_reward_fn. Did you mean 'task_config'?",
        ),
        (
            {"reward_fn": {"_target_": GOLD, "weight": 2.0}},
            "algo.reward_fn.weight: unknown argument of gold_reward_fn.",
        ),
        ({"reward_fn": {"_target_": "lit_rlhf.nope.fn"}}, "algo.reward_fn._target_: cannot import 'lit_rlhf.nope.fn'"),
        (
            {"reward_path": "/rm", "gold_reward_fn": {"task_config": {}}},
            "algo.gold_reward_fn._target_: must be the dotted",
        ),
    ],
)
def test_reward_callables_are_checked_item_by_item(values, expected):
    """Each entry of algo.reward_fns (and reward_fn, gold_reward_fn) is checked before anything is
    built, its factory imported and its arguments matched to the factory's signature: Hydra's
    instantiate never meets a bad one (it would fail with a traceback when the stage builds)."""
    from lit_rlhf.modules.configs import CriticFreeConfig

    with pytest.raises(ConfigError) as err:
        build_config(CriticFreeConfig, values, "algo")
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)


def test_good_reward_callables_pass():
    from lit_rlhf.modules.configs import CriticFreeConfig

    fns = [{"_target_": GOLD, "weight": 2, "name": "gold"}, {"_target_": GOLD, "weight": -0.5, "task_config": None}]
    assert build_config(CriticFreeConfig, {"reward_fns": fns}, "algo").reward_fns[0]["weight"] == 2


@pytest.mark.parametrize(
    "lora, expected",
    [
        ({"r": 0}, "model.lora.r: must be >= 1, got 0"),
        ({"r": 2.5}, "model.lora.r: expected an integer, got 2.5"),
        ({"alpha": 0}, "model.lora.alpha: must be > 0, got 0.0"),
        ({"alpha": float("inf")}, "model.lora.alpha: must be a finite number, got inf"),
        ({"dropout": 1.0}, "model.lora.dropout: must be >= 0.0 and < 1.0, got 1.0"),
        ({"dropout": -0.1}, "model.lora.dropout: must be >= 0.0 and < 1.0, got -0.1"),
        ({"target_modules": []}, "model.lora.target_modules: must name at least one module"),
        ({"target_modules": "q_proj"}, "model.lora.target_modules: expected a list, got 'q_proj'"),
        ({"target_modules": ["q_proj", 3]}, "model.lora.target_modules[1]: expected a string, got 3"),
        ({"target_modules": ["q_proj", ""]}, "model.lora.target_modules: each entry must be a non-empty module name"),
        (
            {"target_modules": ["q_proj v_proj"]},
            "model.lora.target_modules: each entry must be a non-empty module name",
        ),
        # peft would read all-linear as a module name here and adapt only q_proj
        ({"target_modules": ["all-linear", "q_proj"]}, "model.lora.target_modules: all-linear stands alone"),
        ({"export": "full"}, "model.lora.export: must be one of ['adapter', 'merged'], got 'full'"),
        ({"rank": 8}, "model.lora.rank: unknown key for LoraSpec."),
    ],
)
def test_lora_values_name_their_key(lora, expected):
    from lit_rlhf.models.spec import ModelSpec

    with pytest.raises(ConfigError) as err:
        build_config(ModelSpec, {"name_or_path": "m", "lora": {"enabled": True, **lora}}, "model")
    assert str(err.value).startswith(expected), str(err.value)


@pytest.mark.parametrize(
    "node, expected",
    [
        ({"gpu_memory_gb": 0}, "memory_plan.gpu_memory_gb: must be > 0, got 0.0"),
        ({"gpu_memory_gb": -80}, "memory_plan.gpu_memory_gb: must be > 0, got -80.0"),
        ({"gpu_memory_gb": float("inf")}, "memory_plan.gpu_memory_gb: must be a finite number of GiB, got inf"),
        ({"gpu_memory_gb": "80GB"}, "memory_plan.gpu_memory_gb: expected a number, got '80GB'"),
        ({"gpu_memory_gb": 16, "reserve_gb": 16}, "memory_plan.reserve_gb: must be less than gpu_memory_gb=16, got 16"),
        ({"reserve_gb": -1}, "memory_plan.reserve_gb: must be >= 0, got -1.0"),
        ({"enforce": "no"}, "memory_plan.enforce: expected true or false, got 'no'"),
        ({"gpu_mem_gb": 80}, "memory_plan.gpu_mem_gb: unknown key for PlanSettings. Did you mean 'gpu_memory_gb'?"),
        (80, "memory_plan: must be a mapping (gpu_memory_gb, reserve_gb, enforce, only), got 80"),
    ],
)
def test_memory_plan_values_name_their_key(node, expected):
    from lit_rlhf.launch.memory_plan import gpu_memory_gb, plan_settings

    cfg = OmegaConf.create({"memory_plan": node})
    for read in (plan_settings, gpu_memory_gb):  # the plan reads the GPU memory through the check
        with pytest.raises(ConfigError) as err:
            read(cfg)
        assert str(err.value).startswith(expected), str(err.value)
    good = OmegaConf.create({"memory_plan": {"gpu_memory_gb": 80, "reserve_gb": 2.0, "enforce": True}})
    assert (plan_settings(good).gpu_memory_gb, gpu_memory_gb(good)) == (80.0, 80.0)
