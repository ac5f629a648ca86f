"""The sequence-level and weight-clipped objectives of core/losses.py (GSPO, GSPO-token, CISPO, GMPO)
against their papers' formulas written independently here as float64 loops over responses and
tokens, value and gradient; on-policy each reduces to the plain policy gradient of its family."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rlhf.core.losses import (
    aggregate,
    cispo_policy_loss,
    gmpo_policy_loss,
    gspo_policy_loss,
)
from lit_rlhf.core.objectives import POLICY_LOSSES

gspo_token_policy_loss = POLICY_LOSSES["gspo_token"].fn

F64 = torch.float64


def _batch(seed: int = 0, b: int = 4, t: int = 6, per_token_adv: bool = False, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.1
    new = (old + torch.randn(b, t, generator=g, dtype=F64) * scale).requires_grad_()
    lengths = [t, t - 2, 1, t - 3][:b]
    mask = torch.zeros(b, t, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv = torch.randn(b, t, generator=g, dtype=F64)
    if not per_token_adv:
        adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    return new, old, adv, mask


def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(mask.shape[0])]


def _gspo_reference(new, old, adv, mask, lo, hi, token_level):
    """Zheng et al. 2025 Eq. 5–7 (and Eq. 13 for the token variant), (1/G) Σ_i (1/|y_i|) Σ_t ..."""
    total = 0.0
    for i, toks in enumerate(_rows(mask)):
        if not toks:
            continue
        s = torch.exp(sum(new[i, t] - old[i, t] for t in toks) / len(toks))
        row = 0.0
        for t in toks:
            r = s.detach() * torch.exp(new[i, t] - new[i, t].detach()) if token_level else s
            a = adv[i, t]
            row = row + torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
        total = total - row / len(toks)
    return total / mask.shape[0]


def _cispo_reference(new, old, adv, mask, lo, hi):
    """MiniMax-M1 Eq. 4: (1/Σ|o_i|) Σ_i Σ_t sg(clip(r, 1-ε_low, 1+ε_high)) A log π, maximised."""
    total, count = 0.0, 0
    for i, toks in enumerate(_rows(mask)):
        for t in toks:
            w = torch.clamp(torch.exp(new[i, t] - old[i, t]).detach(), 1 - lo, 1 + hi)
            total = total - w * adv[i, t] * new[i, t]
            count += 1
    return total / count


def _gmpo_reference(new, old, adv, mask, lo, hi):
    """Zhao et al. 2025 Eq. 7: (1/G) Σ_i {Π_t min(ρ^sgn, clip(ρ)^sgn)}^(sgn/|o_i|) · A_i, maximised."""
    total = 0.0
    for i, toks in enumerate(_rows(mask)):
        if not toks:
            continue
        a = adv[i, toks[0]]
        sgn = torch.sign(a)
        prod = 1.0
        for t in toks:
            rho = torch.exp(new[i, t] - old[i, t])
            prod = prod * torch.minimum(rho**sgn, torch.clamp(rho, 1 - lo, 1 + hi) ** sgn)
        total = total - prod ** (sgn / len(toks)) * a
    return total / mask.shape[0]


def _check(ours, reference, new):
    (g1,) = torch.autograd.grad(ours, new)
    (g2,) = torch.autograd.grad(reference, new)
    assert float(ours) == pytest.approx(float(reference), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)
    return g1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_paper_off_policy(seed):
    new, old, adv, mask = _batch(seed, scale=0.05)  # a response's ratio close to its clip range
    for lo, hi in [(3e-4, 4e-4), (0.02, 0.03)]:
        loss, stats = gspo_policy_loss(new, old, adv, mask, lo, hi)
        _check(loss, _gspo_reference(new, old, adv, mask, lo, hi, token_level=False), new)
    assert 0.0 <= float(stats["clipfrac"]) <= 1.0


def test_gspo_token_matches_eq13_with_per_token_advantages_and_equals_gspo_with_one_advantage():
    new, old, adv, mask = _batch(3, per_token_adv=True, scale=0.05)
    loss, _ = gspo_token_policy_loss(new, old, adv, mask, 0.02, 0.03)
    token_grad = _check(loss, _gspo_reference(new, old, adv, mask, 0.02, 0.03, token_level=True), new)
    seq_loss, _ = gspo_policy_loss(new, old, adv, mask, 0.02, 0.03)
    (seq_grad,) = torch.autograd.grad(seq_loss, new)
    assert not torch.allclose(token_grad, seq_grad)  # per-token advantages: the token variant's own gradient
    new, old, adv, mask = _batch(4, scale=0.05)  # one advantage per response: the same value and gradient
    a, _ = gspo_policy_loss(new, old, adv, mask, 0.02, 0.03)
    b, _ = gspo_token_policy_loss(new, old, adv, mask, 0.02, 0.03)
    _check(a, b, new)


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_the_paper_and_clipped_tokens_keep_their_gradient(seed):
    new, old, adv, mask = _batch(seed, per_token_adv=True, scale=0.5)  # many weights leave the range
    loss, stats = cispo_policy_loss(new, old, adv, mask, 1.0, 0.28)
    grad = _check(loss, _cispo_reference(new, old, adv, mask, 1.0, 0.28), new)
    ratio = torch.exp(new - old).detach()
    truncated = (ratio > 1.28) & (mask > 0) & (adv != 0)
    assert truncated.any() and (grad[truncated] != 0).all()  # PPO's clip would zero these
    assert float(stats["clipfrac"]) == pytest.approx(float(((ratio > 1.28) & (mask > 0)).sum() / mask.sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmpo_matches_the_paper(seed):
    new, old, adv, mask = _batch(seed, scale=0.5)
    lo, hi = 1 - math.exp(-0.4), math.exp(0.4) - 1
    loss, stats = gmpo_policy_loss(new, old, adv, mask, lo, hi)
    grad = _check(loss, _gmpo_reference(new, old, adv, mask, lo, hi), new)
    assert float(stats["clipfrac"]) > 0  # the log-space clip acted on some tokens
    assert (grad[mask > 0] != 0).any() and torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))


def _plain_policy_gradient(new, adv, mask, aggregation):
    """REINFORCE with the advantage: −A ℓ per token, aggregated as the objective aggregates."""
    return aggregate(-adv * new, mask, aggregation)


@pytest.mark.parametrize(
    "fn, aggregation",
    [
        (gspo_policy_loss, "seq_mean_token_mean"),
        (gspo_token_policy_loss, "seq_mean_token_mean"),
        (cispo_policy_loss, "token_mean"),
        (gmpo_policy_loss, "seq_mean_token_mean"),
    ],
)
def test_on_policy_every_objective_is_the_plain_policy_gradient(fn, aggregation):
    """π = π_old: the gradient is the plain policy gradient of the same aggregation, and the value
    −⟨A⟩ (CISPO's −⟨A ℓ⟩, its log π form)."""
    new, _, adv, mask = _batch(5)
    old = new.detach().clone()
    loss, stats = fn(new, old, adv, mask, aggregation=aggregation)
    (grad,) = torch.autograd.grad(loss, new)
    plain = _plain_policy_gradient(new, adv, mask, aggregation)
    (expected,) = torch.autograd.grad(plain, new)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    value = plain if fn is cispo_policy_loss else aggregate(-adv, mask, aggregation)
    assert float(loss) == pytest.approx(float(value), rel=1e-10)
    assert float(stats["clipfrac"]) == 0.0 and float(stats["ratio_mean"]) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "cispo", "gmpo"])
def test_padding_contributes_nothing_and_extreme_ratios_stay_finite(name):
    fn = POLICY_LOSSES[name].fn
    new, old, adv, mask = _batch(6)
    base, _ = fn(new, old, adv, mask)
    (g_base,) = torch.autograd.grad(base, new)
    pad = mask == 0
    junk_new = torch.where(pad, torch.full_like(new, float("nan")), new.detach()).requires_grad_()
    junk_old = torch.where(pad, torch.full_like(old, float("inf")), old)
    junk_adv = torch.where(pad, torch.full_like(adv, float("-inf")), adv)
    loss, stats = fn(junk_new, junk_old, junk_adv, mask)
    (grad,) = torch.autograd.grad(loss, junk_new)
    assert float(loss) == pytest.approx(float(base), rel=1e-12)
    assert torch.equal(grad[pad], torch.zeros_like(grad[pad])) and torch.allclose(grad, g_base)
    assert all(torch.isfinite(v).all() for v in stats.values())
    for shift in (-60.0, 60.0):  # log-ratios far outside any clip
        extreme = (old + shift).requires_grad_()
        loss, stats = fn(extreme, old, adv, mask)
        (grad,) = torch.autograd.grad(loss, extreme)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_dual_clip_is_refused_by_the_objectives_without_one():
    new, old, adv, mask = _batch(7)
    for name in ("gspo", "gspo_token", "cispo", "gmpo"):
        assert not POLICY_LOSSES[name].dual_clip
        with pytest.raises(ValueError, match="no dual clip"):
            POLICY_LOSSES[name].fn(new, old, adv, mask, 0.2, 0.2, 3.0)
