"""SimPO, ORPO and KTO losses (docs/algorithms.md §5.1–§5.3) against hand-computed values and against
each paper's formula written out in plain Python (math module, float64 loops), with their gradients."""

import math

import pytest
import torch

from lit_rlhf.core.losses import kto_loss, kto_reference_point, log1mexp, orpo_loss, simpo_loss


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def log_sigmoid(x: float) -> float:  # −log(1 + e^−x), stable for either sign
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def random_avg_logps(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) pairs of average per-token log-probs in (−4, −0.01), float64."""
    g = torch.Generator().manual_seed(seed)
    return -(torch.rand(n, generator=g, dtype=torch.float64) * 4 + 0.01), -(
        torch.rand(n, generator=g, dtype=torch.float64) * 4 + 0.01
    )


# ---------------------------------------------------------------- log(1 − eˣ)
def test_log1mexp_is_the_formula_everywhere_and_its_gradient_stays_finite_near_zero():
    xs = [-60.0, -20.0, -3.0, -0.7, -math.log(2.0), -0.69, -0.1, -1e-3, -1e-6, -1e-9]
    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    for got, v in zip(y.tolist(), xs):
        assert got == pytest.approx(math.log(-math.expm1(v)), rel=1e-12)  # log(1 − eˣ), exact in float64
    y.sum().backward()
    for got, v in zip(x.grad.tolist(), xs):  # d/dx log(1 − eˣ) = −eˣ / (1 − eˣ)
        assert got == pytest.approx(-math.exp(v) / -math.expm1(v), rel=1e-9)
    # fp32 at −1e-9: the naive log1p(−eˣ) is −inf there (eˣ rounds to 1), this one is the true −20.72
    x32 = torch.tensor([-1e-9], requires_grad=True)
    assert torch.log1p(-torch.exp(x32.detach())).isinf().all()
    y32 = log1mexp(x32)
    assert y32.item() == pytest.approx(math.log(1e-9), rel=1e-6)
    y32.backward()
    assert torch.isfinite(x32.grad).all()


# ------------------------------------------------------------------- SimPO
def naive_simpo(c: list[float], r: list[float], beta: float, ratio: float, s: float) -> float:
    """−(1/B) Σ [(1 − s) log σ(β p̄_w − β p̄_l − γ) + s log σ(−(…))], γ = β·ratio (SimPO's objective)."""
    total = 0.0
    for pw, pl in zip(c, r):
        h = beta * pw - beta * pl - beta * ratio
        total += -(1 - s) * log_sigmoid(h) - s * log_sigmoid(-h)
    return total / len(c)


def test_simpo_hand_values():
    # p̄_w = −1, p̄_l = −2, β = 2, γ/β = 0.5 (γ = 1): h = 2·1 − 1 = 1, loss = log(1 + e^−1) = 0.3132617
    loss, stats = simpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=2.0, gamma_beta_ratio=0.5)
    assert loss.item() == pytest.approx(0.3132617, abs=1e-6)
    assert stats["chosen_rewards"].item() == -2.0 and stats["rejected_rewards"].item() == -4.0  # β·p̄
    # a pair inside the margin is still pushed: h = 2·0.25 − 1 = −0.5, loss = log(1 + e^0.5) = 0.9740770
    loss, _ = simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.25]), beta=2.0, gamma_beta_ratio=0.5)
    assert loss.item() == pytest.approx(0.9740770, abs=1e-6)
    # label smoothing 0.1 on the first pair: 0.9·log(1 + e^−1) + 0.1·log(1 + e^1) = 0.2819355 + 0.1313262
    loss, _ = simpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), 2.0, 0.5, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.4132617, abs=1e-6)


@pytest.mark.parametrize("beta, ratio, s", [(2.0, 0.5, 0.0), (2.5, 0.55, 0.0), (10.0, 0.3, 0.2), (0.5, 0.0, 0.0)])
def test_simpo_matches_the_formula_and_its_gradient(beta, ratio, s):
    c, r = random_avg_logps(16, seed=int(beta * 10))
    c.requires_grad_()
    loss, _ = simpo_loss(c, r, beta, ratio, s)
    assert loss.item() == pytest.approx(naive_simpo(c.tolist(), r.tolist(), beta, ratio, s), rel=1e-12)
    loss.backward()
    for i, (pw, pl) in enumerate(zip(c.tolist(), r.tolist())):  # ∂/∂p̄_w: −β[(1 − s)σ(−h) − sσ(h)] / B
        h = beta * (pw - pl) - beta * ratio
        assert c.grad[i].item() == pytest.approx(-beta * ((1 - s) * sigmoid(-h) - s * sigmoid(h)) / 16, rel=1e-9)


# -------------------------------------------------------------------- ORPO
def naive_orpo(c: list[float], r: list[float], lam: float) -> tuple[float, float, float]:
    """(L, L_SFT, L_OR) with P = e^p̄, odds = P / (1 − P), L_OR = −log σ(log(odds_w / odds_l))
    = −log(odds_w / (odds_w + odds_l)) (σ(log a − log b) = a / (a + b)), averaged over pairs."""
    nll = sum(-pw for pw in c) / len(c)
    odds = [(math.exp(pw) / (1 - math.exp(pw)), math.exp(pl) / (1 - math.exp(pl))) for pw, pl in zip(c, r)]
    l_or = sum(-math.log(ow / (ow + ol)) for ow, ol in odds) / len(c)
    return nll + lam * l_or, nll, l_or


def test_orpo_hand_values():
    # P_w = 0.5 (odds 1), P_l = 0.2 (odds 0.25): odds ratio 4, σ(log 4) = 0.8, L_OR = −log 0.8 = log 1.25
    # = 0.2231436; L_SFT = −log 0.5 = 0.6931472; λ = 0.1: L = 0.6931472 + 0.0223144 = 0.7154615
    loss, stats = orpo_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]), beta=0.1)
    assert loss.item() == pytest.approx(0.7154615, abs=1e-6)
    assert stats["nll_loss"].item() == pytest.approx(0.6931472, abs=1e-6)
    assert stats["or_loss"].item() == pytest.approx(0.2231436, abs=1e-6)
    assert stats["log_odds_chosen"].item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert stats["chosen_rewards"].item() == pytest.approx(0.1 * math.log(0.5))  # λ·p̄ (TRL's rewards)
    # equal odds: L_OR = log 2, whatever λ
    _, stats = orpo_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-1.0, -3.0]), beta=1.0)
    assert stats["or_loss"].item() == pytest.approx(math.log(2.0), abs=1e-6)


@pytest.mark.parametrize("lam", [0.1, 0.25, 1.0])
def test_orpo_matches_the_formula_trl_and_the_numerical_gradient(lam):
    c, r = random_avg_logps(12, seed=int(lam * 100))
    loss, stats = orpo_loss(c, r, lam)
    expected, nll, l_or = naive_orpo(c.tolist(), r.tolist(), lam)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert (stats["nll_loss"].item(), stats["or_loss"].item()) == pytest.approx((nll, l_or), rel=1e-12)
    # TRL's odds_ratio_loss on the same inputs: log_odds = (p̄_w − p̄_l) − (log1p(−e^p̄_w) − log1p(−e^p̄_l)),
    # loss = nll − λ·mean(logsigmoid(log_odds))
    trl_log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    trl = -c.mean() - lam * torch.nn.functional.logsigmoid(trl_log_odds).mean()
    assert loss.item() == pytest.approx(trl.item(), rel=1e-12)
    torch.autograd.gradcheck(
        lambda a, b: orpo_loss(a, b, lam)[0], (c.clone().requires_grad_(), r.clone().requires_grad_())
    )


# --------------------------------------------------------------------- KTO
def naive_kto(logps, refs, labels, z, beta, wd, wu) -> float:
    """(1/B) Σ λ_y − v(x, y): λ_D(1 − σ(β(r − z))) if desirable else λ_U(1 − σ(β(z − r))), r = log π − log π_ref."""
    total = 0.0
    for lp, rp, good in zip(logps, refs, labels):
        rew = lp - rp
        total += wd * (1 - sigmoid(beta * (rew - z))) if good else wu * (1 - sigmoid(beta * (z - rew)))
    return total / len(logps)


def test_kto_reference_point_hand_values():
    """z_ref = max(0, mean of the mismatched pairs' log-ratios), detached; ``reduce`` sums over ranks."""
    z = kto_reference_point(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0]))  # log-ratios 1, −1
    assert z.item() == 0.0
    z = kto_reference_point(torch.tensor([-2.0, -3.0]), torch.tensor([-4.0, -4.0]))  # 2, 1 → 1.5
    assert z.item() == 1.5
    assert kto_reference_point(torch.tensor([-5.0, -6.0]), torch.tensor([-4.0, -4.0])).item() == 0.0  # −1, −2: clamped
    # another rank holds one pair with log-ratio 3: the mean runs over all three pairs, (2 + 1 + 3) / 3
    other = torch.tensor([3.0, 1.0], dtype=torch.float64)
    z = kto_reference_point(torch.tensor([-2.0, -3.0]), torch.tensor([-4.0, -4.0]), reduce=lambda t: t.add_(other))
    assert z.item() == 2.0
    p = torch.tensor([-2.0, -3.0], requires_grad=True)
    assert kto_reference_point(p, torch.tensor([-4.0, -4.0])).grad_fn is None  # no gradient through z_ref


def test_kto_loss_hand_values():
    # r = (1, −1), z = 0.5, β = 1: desirable 1 − σ(0.5) = 0.3775407, undesirable 1 − σ(1.5) = 0.1824255;
    # λ_D = 1, λ_U = 2: (0.3775407 + 2·0.1824255) / 2 = 0.3711959
    loss, stats = kto_loss(
        torch.tensor([-2.0, -3.0]),
        torch.tensor([-3.0, -2.0]),
        torch.tensor([True, False]),
        torch.tensor(0.5),
        beta=1.0,
        desirable_weight=1.0,
        undesirable_weight=2.0,
    )
    assert loss.item() == pytest.approx(0.3711959, abs=1e-6)
    assert stats["rewards"].tolist() == [1.0, -1.0] and stats["kl"].item() == 0.5


@pytest.mark.parametrize("beta, wd, wu", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.75, 1.0)])
def test_kto_matches_the_formula_and_its_gradient(beta, wd, wu):
    g = torch.Generator().manual_seed(int(beta * 10))
    logps = (-torch.rand(10, generator=g, dtype=torch.float64) * 20).requires_grad_()
    refs = -torch.rand(10, generator=g, dtype=torch.float64) * 20
    labels = torch.rand(10, generator=g) < 0.5
    kl_p, kl_r = (
        -torch.rand(10, generator=g, dtype=torch.float64) * 20,
        -torch.rand(10, generator=g, dtype=torch.float64) * 20,
    )
    z = kto_reference_point(kl_p, kl_r)
    z_naive = max(0.0, sum(a - b for a, b in zip(kl_p.tolist(), kl_r.tolist())) / 10)
    assert z.item() == pytest.approx(z_naive, rel=1e-12)
    loss, _ = kto_loss(logps, refs, labels, z, beta, wd, wu)
    assert loss.item() == pytest.approx(
        naive_kto(logps.tolist(), refs.tolist(), labels.tolist(), z_naive, beta, wd, wu), rel=1e-12
    )
    loss.backward()
    for i, (lp, rp, good) in enumerate(zip(logps.tolist(), refs.tolist(), labels.tolist())):
        rew = lp - rp  # ∂/∂r of λ(1 − σ(±β(r − z))) = ∓λβσ(u)(1 − σ(u))
        u = beta * (rew - z_naive) if good else beta * (z_naive - rew)
        grad = -wd * beta * sigmoid(u) * (1 - sigmoid(u)) if good else wu * beta * sigmoid(u) * (1 - sigmoid(u))
        assert logps.grad[i].item() == pytest.approx(grad / 10, rel=1e-9)
