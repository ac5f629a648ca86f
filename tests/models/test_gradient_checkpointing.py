"""Gradient checkpointing (``model.gradient_checkpointing``) recomputes activations in the backward
pass: the gradients must be the ones without it, for the policy, the critic and LoRA adapters."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.models.lora import add_lora
from lit_rlhf.models.spec import LoraSpec
from lit_rlhf.models.value import ValueModel
from tests.helpers.presets import preset


def _grads(model, loss_fn) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    loss_fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pair(tiny_spec, tokenizer):
    torch.manual_seed(0)
    plain = build_causal_lm(tiny_spec, tokenizer)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return plain, checkpointed


IDS = torch.randint(4, 60, (3, 9), generator=torch.Generator().manual_seed(1))
MASK = torch.ones_like(IDS)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_policy_gradients_are_unchanged(tiny_spec, tokenizer):
    plain, ckpt = _pair(tiny_spec, tokenizer)
    assert ckpt.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    loss = lambda m: m(input_ids=IDS, labels=IDS).loss  # noqa: E731
    _same(_grads(plain, loss), _grads(ckpt, loss))


def test_critic_gradients_are_unchanged(tiny_spec, tokenizer):
    plain, ckpt = _pair(tiny_spec, tokenizer)
    torch.manual_seed(2)
    a = ValueModel(plain)
    b = ValueModel(ckpt, head=copy.deepcopy(a.head))
    loss = lambda m: (m(IDS, MASK) ** 2).mean()  # noqa: E731
    grads = _grads(a, loss)
    assert any(k.startswith("head.") for k in grads) and any(k.startswith("backbone.") for k in grads)
    _same(grads, _grads(b, loss))


def test_lora_adapter_gradients_are_unchanged(tiny_spec, tokenizer):
    plain, ckpt = _pair(tiny_spec, tokenizer)
    spec = LoraSpec(enabled=True, r=4, dropout=0.0)
    torch.manual_seed(3)
    add_lora(plain, spec)
    torch.manual_seed(3)
    add_lora(ckpt, spec)
    with torch.no_grad():  # B = 0 at init would give A no gradient: start from a non-zero update
        for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
            if ".lora_B." in n:
                p.normal_(0, 0.1)
                q.copy_(p)
    loss = lambda m: m(input_ids=IDS, labels=IDS).loss  # noqa: E731
    grads = _grads(plain, loss)
    assert all(".lora_" in n for n in grads)  # only adapters get gradients
    _same(grads, _grads(ckpt, loss))


def test_the_switch_reaches_every_trained_model(tiny_spec, tokenizer, saved_models):
    """model.gradient_checkpointing=true turns it on in the SFT policy, the PPO actor and critic,
    and the DPO/GRPO policies (every model built from the spec)."""
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import CriticFreeConfig, DPOConfig
    from lit_rlhf.modules.critic_free import CriticFreeModule
    from lit_rlhf.modules.dpo import DPOModule
    from lit_rlhf.modules.sft import SFTModule
    from lit_rlhf.utils.config import build_config
    from tests.helpers.ppo import make

    spec = replace(tiny_spec, gradient_checkpointing=True)
    sft = SFTModule(model=spec, tokenizer=tokenizer)
    sft.configure_model()
    assert sft.model.is_gradient_checkpointing
    ppo = make(saved_models, tokenizer)
    ppo.model_spec = replace(ppo.model_spec, gradient_checkpointing=True)
    ppo.configure_model()
    assert ppo.actor.is_gradient_checkpointing and ppo.critic.backbone.is_gradient_checkpointing
    policy = ModelSpec(name_or_path=saved_models[0], gradient_checkpointing=True)
    dpo = DPOModule(
        build_config(DPOConfig, preset("dpo", policy_path=saved_models[0]), "algo"), model=policy, tokenizer=tokenizer
    )
    dpo.configure_model()
    assert dpo.policy.is_gradient_checkpointing
    grpo = CriticFreeModule(
        build_config(
            CriticFreeConfig, preset("grpo", policy_path=saved_models[0], reward_path=saved_models[1]), "algo"
        ),
        model=policy,
        tokenizer=tokenizer,
    )
    grpo.configure_model()
    assert grpo.actor.is_gradient_checkpointing
