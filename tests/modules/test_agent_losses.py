"""A multi-turn rollout trains the policy's tokens only (docs/agents.md §3): the environment's tokens are
context for every forward and nothing else. A real rollout of each stage is made multi-turn by hand
(some response tokens become the environment's: ``response_mask`` 0, ``response_attention_mask`` 1),
then the stage's own advantages and loss run on it, with the forward's outputs as leaves."""

from __future__ import annotations

import pytest
import torch

from lit_rlhf.modules.rl import PolicyForward
from tests.helpers import ppo
from tests.modules.test_grpo_module import Keep, data, fit, make


def _multi_turn(module, dm):
    """One fitted iteration's rollout with columns 2..4 of every response turned into the
    environment's reply (its responses are all at least 6 tokens: the random policy rarely ends)."""
    keep = Keep()
    fit(module, dm, 1, callbacks=[keep])
    rollout = keep.outputs[0]["rollout"]
    attention = rollout.response_mask.clone()
    env = torch.zeros_like(attention, dtype=torch.bool)
    env[:, 2:5] = attention[:, 2:5].bool()
    assert env.any()
    rollout.response_attention_mask = attention
    rollout.response_mask = attention * (~env).to(attention.dtype)
    return rollout, env


def _leaf_forward(module, rollout):
    """The stage's training forward on the rollout, its outputs detached into leaves that record
    the gradient the loss sends them."""
    fwd = module.policy_forward(rollout)
    leaves = PolicyForward(
        fwd.logprobs.detach().requires_grad_(),
        fwd.entropy.detach().requires_grad_(),
        None if fwd.values is None else fwd.values.detach().requires_grad_(),
    )
    return fwd, leaves


@pytest.mark.parametrize("stage", ["grpo_kl_in_loss", "ppo_max"])
def test_the_environments_tokens_get_no_gradient_no_kl_and_no_entropy(saved_models, tokenizer, stage):
    torch.manual_seed(0)
    if stage == "ppo_max":
        module = ppo.make(
            saved_models, tokenizer, entropy_coef=0.01, kl_coef=0.05, kl_placement="loss", kl_estimator="k3"
        )
        dm = ppo.data(tokenizer)
    else:
        module, dm = make(saved_models, tokenizer, kl_coef=0.05), data(tokenizer)
    rollout, env = _multi_turn(module, dm)
    module.compute_advantages(rollout)
    assert (rollout.advantages[env] == 0).all() and (rollout.advantages[~env & rollout.response_mask.bool()] != 0).any()
    if rollout.returns is not None:  # PPO: GAE over the policy's tokens, no return at the environment's
        assert (rollout.returns[env] == 0).all()
    # the environment's tokens are context: other tokens there change the policy's later log-probs
    fwd, leaves = _leaf_forward(module, rollout)
    other = rollout.select(torch.arange(rollout.response_mask.shape[0]))
    other.response_ids = torch.where(env, (other.response_ids + 1) % len(tokenizer), other.response_ids)
    later = rollout.response_mask.bool() & (torch.arange(env.shape[1]) >= 5)
    assert not torch.allclose(module.policy_forward(other).logprobs[later], fwd.logprobs[later])
    loss, stats = module.minibatch_loss(rollout, leaves, None)
    loss.backward()
    for name in ("logprobs", "entropy", "values"):
        grad = getattr(leaves, name)
        if grad is None or grad.grad is None:
            continue
        assert (grad.grad[env] == 0).all(), name
        assert (grad.grad[rollout.response_mask.bool()] != 0).any(), name
    assert stats["policy/kl_loss"] > 0  # the KL term is there, over the policy's tokens only
    # the statistics the monitors read (length, KL, entropy) count the policy's tokens only
    assert rollout.response_lengths.tolist() == rollout.response_mask.sum(-1).tolist()
    assert torch.equal(rollout.valid_mask, rollout.response_mask * torch.isfinite(rollout.scores)[:, None])
