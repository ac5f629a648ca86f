import math

import pytest
import torch

from lit_rlhf.core.losses import pairwise_rm_loss


def sp(x):  # -logsigmoid(x) = log(1 + e^-x), by hand
    return math.log1p(math.exp(-x))


def test_bradley_terry_hand_values():
    loss, stats = pairwise_rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((sp(1.0) + sp(-1.0)) / 2)  # = (0.31326 + 1.31326) / 2
    assert loss.item() == pytest.approx(0.813262, abs=1e-6)
    assert stats["accuracy"].item() == 0.5 and stats["margin"].item() == 0.0
    assert stats["score_mean"].item() == 1.0
    assert stats["score_std"].item() == pytest.approx(math.sqrt(((2 - 1) ** 2 + 1 + 0 + 0) / 4))


def test_margin_shifts_the_difference():
    loss, _ = pairwise_rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=torch.tensor([0.5, 0.0]))
    assert loss.item() == pytest.approx((sp(0.5) + sp(-1.0)) / 2)  # (0.474077 + 1.313262) / 2
    assert loss.item() == pytest.approx(0.893670, abs=1e-6)


def test_centering_term():
    loss, stats = pairwise_rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), center_coef=0.1)
    assert stats["center_loss"].item() == pytest.approx((9 + 1) / 2)
    assert loss.item() == pytest.approx(0.813262 + 0.1 * 5.0, abs=1e-6)


def test_matches_naive_loop_with_gradients():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(6, generator=g, requires_grad=True)
    r = torch.randn(6, generator=g, requires_grad=True)
    m = torch.rand(6, generator=g)
    loss, _ = pairwise_rm_loss(c, r, m, center_coef=0.05)
    loss.backward()
    cn, rn = c.detach().tolist(), r.detach().tolist()
    naive = sum(sp(a - b - mm) + 0.05 * (a + b) ** 2 for a, b, mm in zip(cn, rn, m.tolist())) / 6
    assert loss.item() == pytest.approx(naive, rel=1e-6)
    # d/dc of log(1+e^-(c-r-m)) = -σ(-(c-r-m)); of 0.05(c+r)^2 = 0.1(c+r); divided by B
    for i in range(6):
        d = cn[i] - rn[i] - m[i].item()
        expected = (-1 / (1 + math.exp(d)) + 0.1 * (cn[i] + rn[i])) / 6
        assert c.grad[i].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_extreme_gaps_stay_exact():
    loss, _ = pairwise_rm_loss(torch.tensor([-100.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(100.0)  # log(σ + 1e-5) would cap it at 11.5
    loss, _ = pairwise_rm_loss(torch.tensor([100.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(0.0, abs=1e-30) and torch.isfinite(loss)
