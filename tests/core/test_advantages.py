import pytest
import torch

from lit_rlhf.core.advantages import gae


def naive_gae(rewards, values, lengths, gamma, lam):
    """Row by row, over each response's L tokens, V_L := 0, A_L := 0."""
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    for b in range(B):
        last = 0.0
        for t in reversed(range(lengths[b])):
            next_v = values[b, t + 1].item() if t + 1 < lengths[b] else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    ret = (adv + values) * (torch.arange(T)[None] < torch.tensor(lengths)[:, None])
    return adv, ret


def test_gae_hand_computed():
    # one row, L = 2: R = [0, 1], V = [0.5, 0.25], γ = 1, λ = 0.5
    # δ1 = 1 + 0 - 0.25 = 0.75; A1 = 0.75; δ0 = 0 + 0.25 - 0.5 = -0.25; A0 = -0.25 + 0.5 * 0.75 = 0.125
    adv, ret = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.25, 9.0]]), torch.tensor([[1, 1, 0]]), 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 1.0, 0.0]]))  # values outside the mask never leak in


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 7]
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    rewards = torch.randn(4, 7, generator=g) * mask
    values = torch.randn(4, 7, generator=g)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    n_adv, n_ret = naive_gae(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(adv, n_adv)
    torch.testing.assert_close(ret, n_ret)


def test_lambda_one_gamma_one_returns_are_reward_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    _, ret = gae(rewards, torch.tensor([[0.3, -0.2, 0.7]]), torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[6.0, 5.0, 3.0]]))


def test_non_finite_padding_never_reaches_real_tokens():
    """inf/NaN at padded positions (garbage a forward can leave there) must not poison the row:
    `where`, not `* mask` (inf·0 = NaN)."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, float("inf"), float("nan")], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, float("nan"), float("-inf")], [0.1, 0.2, 0.3, 0.4]])
    adv, ret = gae(rewards, values, mask, 1.0, 0.5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    clean_adv, clean_ret = gae(torch.where(mask.bool(), rewards, 0.0), torch.where(mask.bool(), values, 0.0), mask, 1.0, 0.5)
    torch.testing.assert_close(adv, clean_adv)
    torch.testing.assert_close(ret, clean_ret)
    torch.testing.assert_close(adv[0, :2], torch.tensor([0.125, 0.75]))  # the hand-computed row above
