"""Shared PPO test helpers: tiny saved models, a module from config values, prompt data, a fit."""

import lightning.pytorch as pl
import torch

from lit_rlhf.data.prompts import PromptDataModule
from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.models.reward import build_reward_model
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.configs import PPOConfig
from lit_rlhf.modules.ppo import PPOModule
from lit_rlhf.utils.config import build_config
from tests.helpers.presets import preset


def save_tiny_models(tiny_spec, tokenizer, tmp_path):
    """A random tiny policy and a random tiny causal reward model, saved like the real stages do."""
    torch.manual_seed(0)
    policy = build_causal_lm(tiny_spec, tokenizer)
    policy.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    rm = build_reward_model(tiny_spec, tokenizer)
    rm.save_pretrained(str(tmp_path / "rm"))
    tokenizer.save_pretrained(tmp_path / "rm")
    return str(tmp_path / "policy"), str(tmp_path / "rm")


def make(saved_models, tokenizer, **kw):
    policy, rm = saved_models
    args = dict(
        policy_path=policy,
        reward_path=rm,
        lr=1e-3,
        critic_lr=1e-3,
        rollout_batch_size=8,
        minibatch_size=4,
        generation={"max_new_tokens": 8},
    )
    args.update(kw)
    if "reward_fn" in kw:
        args["reward_path"] = None
    cfg = build_config(PPOConfig, preset("ppo", args), "algo")
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path="model group, unused by PPO"))
    return PPOModule(cfg, model=spec, tokenizer=tokenizer)


def data(tokenizer, batch_size=8, **kw):
    """Prompts of the embedded task; batch_size must be the module's algo.rollout_batch_size (8 in make())."""
    dm = PromptDataModule(n_train=64, n_val=8, batch_size=batch_size, **kw).connect(tokenizer)
    return dm


def fit(module, dm, max_steps, **kw):
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        **kw,
    )
    trainer.fit(module, dm)
    return trainer
