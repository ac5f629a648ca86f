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


# d = trainer − sampler on the response tokens: row 0 [0.5, −1.0, 0.0], row 1 [1.9, 0.2] (and a padded NaN)
R = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(1.9), math.exp(0.2), 0.0]]
SEQ = [math.exp(0.5 - 1.0 + 0.0), math.exp(1.9 + 0.2)]  # products of the token ratios: 0.6065, 8.166
GEO = [math.exp((0.5 - 1.0 + 0.0) / 3), math.exp((1.9 + 0.2) / 2)]  # geometric means: 0.8465, 2.8577


@pytest.mark.parametrize(
    "mode, cap, band, expected, masked",
    [
        ("token_truncate", 2.0, (0.5, 2.0), [[R[0][0], R[0][1], 1.0], [2.0, R[1][1], 0.0]], 0),
        ("token_mask", 2.0, (0.5, 2.0), [[R[0][0], R[0][1], 1.0], [0.0, R[1][1], 0.0]], 1),
        ("decoupled", 2.0, (0.5, 2.0), [[R[0][0], R[0][1], 1.0], [R[1][0], R[1][1], 0.0]], 0),
        ("sequence_truncate", 3.0, (0.5, 2.0), [[SEQ[0]] * 3, [3.0, 3.0, 0.0]], 0),
        ("sequence_mask", 3.0, (0.5, 2.0), [[SEQ[0]] * 3, [0.0, 0.0, 0.0]], 2),
        ("icepop", 2.0, (0.5, 2.0), [[R[0][0], 0.0, 1.0], [0.0, R[1][1], 0.0]], 2),
        ("geo_mask", 2.0, (0.5, 2.0), [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 2),
        ("geo_mask", 2.0, (0.9, 3.0), [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]], 3),
    ],
)
def test_every_correction_against_hand_values(mode, cap, band, expected, masked):
    from lit_rlhf.core.mismatch import correction_weights

    w, stats = correction_weights(TRAINER, SAMPLER, MASK, mode, cap, band)
    assert torch.allclose(w, torch.tensor(expected), atol=1e-5) and not w.requires_grad
    assert stats["correction_masked_frac"].item() == pytest.approx(masked / 5)  # of the 5 response tokens
    kept = sorted(x for row, m in zip(expected, MASK.tolist()) for x, k in zip(row, m) if k)
    assert stats["correction_weight_p50"].item() == pytest.approx(kept[2], rel=1e-5)  # the median of five
    assert stats["correction_weight_p05"].item() <= stats["correction_weight_p95"].item()


def test_tis_is_token_truncate_and_bad_settings_are_refused():
    from lit_rlhf.core.mismatch import correction_weights

    a, _ = correction_weights(TRAINER, SAMPLER, MASK, "tis", 2.0)
    b, _ = correction_weights(TRAINER, SAMPLER, MASK, "token_truncate", 2.0)
    assert torch.equal(a, b) and torch.equal(a, truncated_is_weights(TRAINER, SAMPLER, MASK, 2.0))
    with pytest.raises(ValueError, match="band must satisfy"):
        correction_weights(TRAINER, SAMPLER, MASK, "icepop", 2.0, (2.0, 0.5))
    with pytest.raises(ValueError, match="unknown rollout correction 'tls'"):
        correction_weights(TRAINER, SAMPLER, MASK, "tls", 2.0)
    huge = torch.tensor([[400.0, 400.0, 0.0], [0.0, 0.0, 0.0]])  # a sequence ratio past float range
    w, stats = correction_weights(huge, torch.zeros(2, 3), MASK, "sequence_mask", 3.0)
    assert torch.isfinite(w).all() and w[0].sum() == 0 and all(torch.isfinite(v) for v in stats.values())


def test_decoupled_ppo_against_its_formula_with_three_policies():
    """Hilton et al. 2022, decoupled PPO: behaviour μ (a stale sampler), proximal π_prox (the
    trainer's recomputation), current π_θ. Token t's loss is −(π_prox/μ) · min(r A, clip(r, 1 ± ε) A)
    with r = π_θ/π_prox: the clip is around the proximal policy, the uncapped behaviour weight outside
    it. Written out in float64 loops, value and gradient; with π_θ = π_prox = μ it is the plain policy
    gradient −mean A; a behaviour log-ratio past float range stays finite."""
    from lit_rlhf.core.mismatch import correction_weights

    current = [[-1.0, -0.4, -2.5, -0.7], [-0.2, -1.6, -3.0, 0.0]]
    prox = [[-1.1, -0.5, -2.0, -0.7], [-0.3, -1.0, -3.0, 0.0]]
    behaviour = [[-1.6, -0.2, -2.2, -0.1], [-0.3, -2.9, -2.0, 0.0]]
    adv = [[1.0, -0.5, 2.0, 1.0], [-1.0, 0.7, 0.3, 0.0]]
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]
    eps = 0.2
    n = sum(map(sum, mask))
    want, want_grad = 0.0, [[0.0] * 4 for _ in range(2)]
    for i in range(2):
        for t in range(4):
            if not mask[i][t]:
                continue
            w = math.exp(prox[i][t] - behaviour[i][t])
            r = math.exp(current[i][t] - prox[i][t])
            a = adv[i][t]
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            want -= w * min(unclipped, clipped) / n
            # d/d log π_θ: −w r A where the unclipped term is the min (inside the clip they are equal), else 0
            if unclipped <= clipped:
                want_grad[i][t] = -w * r * a / n

    t64 = dict(dtype=torch.float64)
    logprobs = torch.tensor(current, **t64, requires_grad=True)
    m = torch.tensor(mask, **t64)
    weights, stats = correction_weights(torch.tensor(prox, **t64), torch.tensor(behaviour, **t64), m, "decoupled")
    loss, _ = ppo_policy_loss(
        logprobs, torch.tensor(prox, **t64), torch.tensor(adv, **t64), m, eps, eps, None, is_weights=weights
    )
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-6)  # the weights are float32
    assert torch.allclose(logprobs.grad, torch.tensor(want_grad, **t64), rtol=1e-6, atol=1e-9)
    assert stats["correction_weight_p95"].item() > 2.0  # uncapped: a weight past tis's cap is kept
    coupled, _ = ppo_policy_loss(logprobs, torch.tensor(behaviour, **t64), torch.tensor(adv, **t64), m, eps, eps)
    assert coupled.item() != pytest.approx(want, rel=1e-3)  # PPO clipped around μ is another objective

    # on-policy (π_θ = π_prox = μ): the plain policy gradient, value and gradient
    same = torch.tensor(prox, **t64, requires_grad=True)
    w1, _ = correction_weights(same.detach(), same.detach(), m, "decoupled")
    pg, _ = ppo_policy_loss(same, same.detach(), torch.tensor(adv, **t64), m, eps, eps, is_weights=w1)
    pg.backward()
    a_masked = torch.tensor(adv, **t64) * m
    assert pg.item() == pytest.approx(-a_masked.sum().item() / n, rel=1e-12)
    assert torch.allclose(same.grad, -a_masked / n, rtol=1e-12)

    far = torch.tensor([[300.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w, stats = correction_weights(far, torch.zeros(2, 4), torch.tensor(mask), "decoupled")
    assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in stats.values())


def test_the_correction_names_are_the_configs():
    from lit_rlhf.core.objectives import CORRECTIONS
    from lit_rlhf.modules.configs import CriticFreeConfig
    from lit_rlhf.utils.config import ConfigError, build_config
    from tests.helpers.presets import preset

    base = {"policy_path": "p", "reward_fn": {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}}
    for name in CORRECTIONS:
        build_config(CriticFreeConfig, preset("grpo", {**base, "rollout_correction": name}), "algo")
    with pytest.raises(ConfigError, match="algo.rollout_correction: must be one of"):
        build_config(CriticFreeConfig, preset("grpo", {**base, "rollout_correction": "tls"}), "algo")
    with pytest.raises(ConfigError, match="correction_band_high: must be > algo.correction_band_low"):
        build_config(CriticFreeConfig, preset("grpo", {**base, "correction_band_low": 2.0}), "algo")


def test_the_sampler_kl_of_tiny_gaps_is_their_half_square_not_rounding_noise():
    """Gaps of 1e-6 (an fp32 engine against the trainer) give k3 terms of 5e-13, below float32's
    rounding of e^{-d} + d − 1 (which made the mean slightly negative): computed in float64 it is
    ½·mean d² to first order, and never negative."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(8, 16, generator=g) * 5
    gap = (torch.rand(8, 16, generator=g) - 0.5) * 4e-6
    sampler = trainer + gap
    mask = torch.ones(8, 16)
    stats = sampler_mismatch(trainer, sampler, mask)
    d = (sampler.double() - trainer.double()).flatten()  # the gap as the float32 inputs hold it
    want = float((d**2).mean() / 2)
    assert stats["sampler_kl"].item() >= 0 and stats["sampler_kl"].item() == pytest.approx(want, rel=1e-3)
