"""inf/NaN at padded positions reach neither a loss nor its gradient (docs/algorithms.md §2.9).

Each loss gets the same per-token inputs twice, as leaf tensors: once holding finite values
everywhere, once with inf, −inf or NaN where the mask is 0. The loss must be the same, every
gradient finite and exactly 0 at the padded positions, and the gradients equal. Masking after a
nonlinear op is not enough: d/dx exp(x)·0 at x = inf is 0·inf = NaN in ``.grad``.
"""

import math

import pytest
import torch

from lit_rlhf.core.kl import kl_penalty
from lit_rlhf.core.losses import aggregate, entropy_loss, ppo_policy_loss, ptx_loss, value_loss
from lit_rlhf.core.masked import masked_var, masked_whiten

# row 2 has no valid token (a response left out of the loss)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
PAD = ~MASK.bool()


def _inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.5 for _ in range(n)]


def _run(fn, clean: list[torch.Tensor], fill: float) -> tuple:
    """(loss, grads) of ``fn`` on ``clean``, then (loss, grads) with ``fill`` at the padded positions."""
    out = []
    for xs in (clean, [torch.where(PAD, torch.full_like(x, fill), x) for x in clean]):
        leaves = [x.clone().requires_grad_() for x in xs]
        loss = fn(*leaves)
        loss.backward()
        out += [loss.detach(), [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]]  # None: unused
    return tuple(out)


def assert_padding_stays_out(fn, n_inputs: int) -> None:
    """inf, -inf and NaN at masked positions change neither ``fn``'s value nor its gradients (which are
    finite, exactly 0 there, and equal to the clean inputs'); ``fn`` depends on the real tokens."""
    for fill in (float("inf"), float("-inf"), float("nan")):
        loss, grads, dirty_loss, dirty_grads = _run(fn, _inputs(n_inputs), fill)
        assert torch.isfinite(loss) and torch.equal(dirty_loss, loss), fill
        for grad, clean_grad in zip(dirty_grads, grads):
            assert torch.isfinite(grad).all(), fill
            assert (grad[PAD] == 0).all(), fill
            assert torch.equal(grad, clean_grad), fill
        assert any((g[~PAD] != 0).any() for g in grads)  # the loss does depend on the real tokens


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss(aggregation, dual_clip):
    def fn(lp, old, adv):
        loss, stats = ppo_policy_loss(lp, old, adv, MASK, 0.2, 0.28, dual_clip, aggregation, 5.0)
        assert all(torch.isfinite(v).all() for v in stats.values())
        return loss

    assert_padding_stays_out(fn, 3)


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss(clip):
    assert_padding_stays_out(lambda v, old, ret: value_loss(v, old, ret, MASK, clip)[0], 3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp, k3_max", [(20.0, 10.0), (None, None)])
def test_kl_penalty_with_its_mask(estimator, clamp, k3_max):
    def fn(lp, ref):
        return aggregate(kl_penalty(lp, ref, estimator, clamp, k3_max, mask=MASK), MASK, "seq_mean_token_mean")

    assert_padding_stays_out(fn, 2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_aggregate_entropy_and_ptx(aggregation):
    assert_padding_stays_out(lambda x: aggregate(x, MASK, aggregation, 5.0), 1)
    assert_padding_stays_out(lambda h: entropy_loss(h, MASK, 0.01)[0] + entropy_loss(h, MASK, 0.01, target=1.0)[0], 1)
    assert_padding_stays_out(lambda lp: ptx_loss(lp, MASK)[0], 1)


def test_whitening_and_variance():
    assert_padding_stays_out(lambda x: (masked_whiten(x, MASK) * torch.arange(5.0, dtype=x.dtype)).sum(), 1)
    assert_padding_stays_out(lambda x: masked_var(x, MASK), 1)


def test_kl_penalty_without_a_mask_is_unchanged():
    """No mask: the estimate of every position, as before (k3 at d = 1: e^{−1} + 1 − 1)."""
    lp, ref = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.0]])
    assert kl_penalty(lp, ref, "k3")[0].tolist() == pytest.approx([0.0, math.exp(-1.0)])
    masked = kl_penalty(lp, ref, "k3", mask=torch.tensor([[1, 0]]))
    assert masked.tolist() == [[0.0, 0.0]]
