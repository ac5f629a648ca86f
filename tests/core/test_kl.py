import math

import pytest
import torch

from lit_rlhf.core.kl import AdaptiveKLController, FixedKLController, kl_penalty


def test_estimators_hand_values():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])  # d = [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1) - 2]]))


def test_clamps():
    lp, ref = torch.tensor([[0.0, 0.0]]), torch.tensor([[-50.0, 50.0]])  # d = ±50 -> clamped to ±20
    assert kl_penalty(lp, ref, "k1").tolist() == [[20.0, -20.0]]
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.tolist() == [[10.0, 10.0]]  # e^-20 + 19 and e^20 - 21 both capped at 10
    assert kl_penalty(lp, ref, "k3", k3_max=100.0)[0, 0].item() == pytest.approx(math.exp(-20) + 19)


def test_k3_is_an_unbiased_nonnegative_kl_estimate():
    """Sampling y ~ π, mean k3 ≈ KL(π‖π_ref) computed exactly from two categorical distributions."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, generator=g), -1)
    q = torch.softmax(torch.randn(5, generator=g), -1)
    exact = (p * (p / q).log()).sum().item()
    y = torch.multinomial(p, 200000, replacement=True, generator=g)
    k1 = kl_penalty(p.log()[y], q.log()[y], "k1")
    k3 = kl_penalty(p.log()[y], q.log()[y], "k3", k3_max=1e9)  # the default cap trades bias for safety
    assert (k3 >= 0).all()
    assert k3.mean().item() == pytest.approx(exact, abs=0.01)
    assert k1.mean().item() == pytest.approx(exact, abs=0.01)


def test_fixed_and_adaptive_controllers():
    f = FixedKLController(0.05)
    f.update(100.0, 64)
    assert f.value == 0.05
    a = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    a.update(9.0, 256)  # e = clip(9/6 - 1, ±0.2) = 0.2 -> β · (1 + 0.2 · 256/10000)
    assert a.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    a.update(5.7, 100)  # e = -0.05
    assert a.value == pytest.approx(0.1 * (1 + 0.2 * 0.0256) * (1 - 0.05 * 0.01))
    b = AdaptiveKLController(1.0, 6.0, 10000)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value


def test_sequence_kl_sums_the_estimator_over_each_response():
    from lit_rlhf.core.kl import sequence_kl

    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, float("nan")], [-0.5, -30.5, -0.5]])  # NaN at a padded position
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: d = 0.5, -1.0 -> k1 sum -0.5; row 1: d = 0, 30, 0 -> 30 unclamped, 20 clamped
    torch.testing.assert_close(sequence_kl(lp, ref, mask, clamp=None), torch.tensor([-0.5, 30.0]))
    torch.testing.assert_close(sequence_kl(lp, ref, mask), torch.tensor([-0.5, 20.0]))
    k3 = sequence_kl(lp, ref, mask, "k3")
    torch.testing.assert_close(k3, torch.tensor([math.exp(-0.5) + 0.5 - 1 + math.exp(1) - 2, 10.0]))
    wild = sequence_kl(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), "k3", clamp=None, k3_max=None)
    assert torch.isfinite(wild).all() and wild.item() > 1e30  # e^80 + …: huge, but no inf
