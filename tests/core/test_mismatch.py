"""Sampler–trainer mismatch statistics and truncated importance sampling (lit_rlhf/core/mismatch.py)
against values computed by hand in Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rlhf.core.losses import ppo_policy_loss
from lit_rlhf.core.mismatch import sampler_mismatch, truncated_is_weights

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, float("nan")]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -3.2, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_tis_weights_hand_values():
    w = truncated_is_weights(TRAINER, SAMPLER, MASK, cap=2.0)
    # exp(0.5) = 1.6487, exp(-1) = 0.3679, exp(0) = 1, exp(1.9) = 6.69 -> capped 2, exp(0.2) = 1.2214, masked 0
    expected = [[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, math.exp(0.2), 0.0]]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(TRAINER, SAMPLER, MASK, cap=0.0)


def test_mismatch_statistics_hand_values():
    stats = sampler_mismatch(TRAINER, SAMPLER, MASK)
    diffs = [-0.5, 1.0, 0.0, -1.9, -0.2]  # sampler − trainer on the five response tokens
    k3 = sum(math.exp(-d) + d - 1 for d in diffs) / 5
    assert stats["sampler_kl"].item() == pytest.approx(k3, rel=1e-6)
    assert stats["sampler_logprob_diff_max"].item() == pytest.approx(1.9, rel=1e-6)
    same = sampler_mismatch(TRAINER, TRAINER.nan_to_num(), MASK)
    assert same["sampler_kl"].item() == 0.0 and same["sampler_logprob_diff_max"].item() == 0.0


def test_tis_weights_scale_each_tokens_surrogate():
    """Yao et al. 2025: the loss is the token-mean of w_t · max(−A ρ, −A clip(ρ)); checked against the
    per-token terms written out by hand, with a gradient through ρ only."""
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.5, -1.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3)
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, 0.2, is_weights=w)
    terms = []
    for lp, o, a, wt in zip([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [1.0, -2.0, 0.5], [2.0, 0.5, 1.0]):
        rho = math.exp(lp - o)
        terms.append(wt * max(-a * rho, -a * min(max(rho, 0.8), 1.2)))
    assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-6)
    plain, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    assert not torch.isclose(loss, plain)
    loss.backward()
    # token 0: ρ = e^0.2 = 1.221 > 1.2 with A > 0: clipped, no gradient; token 1: ρ = 1, −A ρ with w 0.5
    assert logprobs.grad[0, 0].item() == 0.0
    assert logprobs.grad[0, 1].item() == pytest.approx(0.5 * 2.0 / 3, rel=1e-6)
