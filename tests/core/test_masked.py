import statistics

import pytest
import torch

from lit_rlhf.core.masked import first_token_index, last_token_index, masked_moments, masked_var, masked_whiten


def test_masked_var_hand_values():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_var(x, m).item() == pytest.approx(statistics.variance([1, 2, 3]))  # 1.0
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(statistics.pvariance([1, 2, 3]))


def test_whiten_against_python_statistics():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3 + 5
    m = (torch.rand(4, 6, generator=g) > 0.3).long()
    vals = x[m.bool()].tolist()
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    w = masked_whiten(x, m)
    for i in range(4):
        for j in range(6):
            expected = (x[i, j].item() - mu) / sd if m[i, j] else 0.0
            assert w[i, j].item() == pytest.approx(expected, abs=1e-5)
    kept = masked_whiten(x, m, shift_mean=False)
    # TRL's shift_mean=False: unit variance, the original mean added back
    assert kept[m.bool()].mean().item() == pytest.approx(mu, rel=1e-4)
    assert statistics.stdev(kept[m.bool()].tolist()) == pytest.approx(1.0, rel=1e-4)


def test_moments_with_a_summing_all_reduce_equal_the_concatenation():
    """Two 'ranks' simulated by an all_reduce that adds the other rank's contribution."""
    g = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(3, 5, generator=g), torch.randn(2, 5, generator=g) + 2
    ma, mb = (torch.rand(3, 5, generator=g) > 0.4).long(), (torch.rand(2, 5, generator=g) > 0.4).long()
    ref_mean, ref_var, ref_n = masked_moments(torch.cat([xa, xb]), torch.cat([ma, mb]))
    calls = []

    def fake_all_reduce(t):  # rank a's view: add rank b's local statistic of the same call
        other = [torch.stack([mb.sum().float(), (xb * mb).sum()]), None][len(calls)]
        if other is None:
            mean = ref_mean
            other = (((xb - mean) ** 2) * mb).sum()
        calls.append(1)
        t += other
        return t

    mean, var, n = masked_moments(xa, ma, fake_all_reduce)
    assert n.item() == ref_n.item()
    assert mean.item() == pytest.approx(ref_mean.item(), abs=1e-6)
    assert var.item() == pytest.approx(ref_var.item(), abs=1e-6)


def test_token_indices_left_and_right():
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    left = torch.tensor([[0, 1, 1], [0, 0, 1]])
    assert last_token_index(right).tolist() == [1, 2] and last_token_index(left).tolist() == [2, 2]
    assert first_token_index(right).tolist() == [0, 0] and first_token_index(left).tolist() == [1, 2]


def test_non_finite_padding_is_ignored_by_moments_and_whitening():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), float("-inf")]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    mean, var, n = masked_moments(x, m)
    assert (n.item(), mean.item(), var.item()) == (3.0, 2.0, 1.0)  # statistics of 1, 2, 3
    w = masked_whiten(x, m)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_position_ids_count_real_tokens():
    from lit_rlhf.core.masked import position_ids_from_mask

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    naive = [[max(0, sum(row[: t + 1]) - 1) for t in range(5)] for row in mask.tolist()]
    assert position_ids_from_mask(mask).tolist() == naive == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
