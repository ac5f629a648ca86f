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
    adv, ret = gae(
        torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.25, 9.0]]), torch.tensor([[1, 1, 0]]), 1.0, 0.5
    )
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


def test_gae_over_a_multi_turn_trajectory_skips_the_environments_tokens():
    """Policy tokens with gaps (the environment's replies, mask 0): GAE over the policy's tokens
    alone, as if the gaps were not there (naive: compact each row, run the loop, scatter back), and
    0 in the gaps."""
    hand = gae(  # R = [0, _, 1], V = [0.5, 9, 0.25], λ = 0.5: the gap is skipped, as in the hand-computed row above
        torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]), torch.tensor([[1, 0, 1]]), 1.0, 0.5
    )
    torch.testing.assert_close(hand[0], torch.tensor([[0.125, 0.0, 0.75]]))
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
    rewards, values = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    adv, ret = gae(rewards, values, mask, 0.99, 0.9)
    for b in range(3):
        cols = mask[b].nonzero().squeeze(-1)
        n = len(cols)
        n_adv, n_ret = naive_gae(rewards[b, cols][None], values[b, cols][None], [n], 0.99, 0.9)
        torch.testing.assert_close(adv[b, cols], n_adv[0])
        torch.testing.assert_close(ret[b, cols], n_ret[0])
        assert (adv[b][mask[b] == 0] == 0).all() and (ret[b][mask[b] == 0] == 0).all()


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
    clean_adv, clean_ret = gae(
        torch.where(mask.bool(), rewards, 0.0), torch.where(mask.bool(), values, 0.0), mask, 1.0, 0.5
    )
    torch.testing.assert_close(adv, clean_adv)
    torch.testing.assert_close(ret, clean_ret)
    torch.testing.assert_close(adv[0, :2], torch.tensor([0.125, 0.75]))  # the hand-computed row above


def naive_group_advantages(rewards, g, scale, loo, eps=1e-4):
    import statistics

    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        for i, r in enumerate(grp):
            base = statistics.mean(grp[:i] + grp[i + 1 :]) if loo else statistics.mean(grp)
            a = r - base
            out.append(a / (statistics.stdev(grp) + eps) if scale else a)
    return out


@pytest.mark.parametrize("scale, loo", [(True, False), (False, False), (False, True), (True, True)])
def test_group_advantages_match_the_naive_loop(scale, loo):
    from lit_rlhf.core.advantages import group_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    adv, no_signal = group_advantages(rewards, 4, scale, "leave_one_out" if loo else "mean")
    expected = naive_group_advantages(rewards.tolist(), 4, scale, loo)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    assert not no_signal.any()


def test_group_advantages_hand_values_equal_groups_and_invalid_samples():
    from lit_rlhf.core.advantages import group_advantages

    # group 1: [1, 3]: mean 2, std (unbiased) √2 → ±1/(√2 + 1e-4); group 2 all equal → 0, no signal
    adv, no_signal = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2)
    torch.testing.assert_close(adv, torch.tensor([-1 / (2**0.5 + 1e-4), 1 / (2**0.5 + 1e-4), 0.0, 0.0]))
    assert no_signal.tolist() == [False, True]
    # a NaN reward leaves its group's statistics and gets advantage 0
    adv, no_signal = group_advantages(torch.tensor([1.0, float("nan"), 3.0, 2.0, 4.0, 6.0]), 3, scale=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -2.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)


def naive_gae_with_dones(rewards, values, dones, next_value, gamma, lam):
    """cleanrl's loop (ppo.py), one env per row; dones[t] = the episode ended with step t."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last = 0.0
        for t in reversed(range(T)):
            next_v = next_value[b].item() if t == T - 1 else values[b, t + 1].item()
            nonterminal = 1.0 - dones[b, t].item()
            delta = rewards[b, t].item() + gamma * next_v * nonterminal - values[b, t].item()
            last = delta + gamma * lam * nonterminal * last
            adv[b, t] = last
    return adv, adv + values


def test_gae_with_episode_ends_and_bootstrap_matches_cleanrl_loop():
    g = torch.Generator().manual_seed(3)
    rewards = torch.ones(3, 9, dtype=torch.float64)
    values = torch.randn(3, 9, generator=g, dtype=torch.float64)
    dones = (torch.rand(3, 9, generator=g) > 0.7).to(torch.float64)
    next_value = torch.randn(3, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones(3, 9), 0.99, 0.95, dones=dones, next_value=next_value)
    n_adv, n_ret = naive_gae_with_dones(rewards, values, dones, next_value, 0.99, 0.95)
    torch.testing.assert_close(adv, n_adv)
    torch.testing.assert_close(ret, n_ret)
    # hand case: one step, episode not over: A = r + γ V' − V = 1 + 0.5·2 − 0.5
    a, _ = gae(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.ones(1, 1), 0.5, 1.0, next_value=torch.tensor([2.0]))
    assert a.item() == pytest.approx(1.5)


BASELINES = [(True, "mean"), (False, "mean"), (False, "leave_one_out"), (True, "leave_one_out")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale, baseline", BASELINES)
def test_an_all_equal_group_is_no_signal_with_advantages_exactly_zero(dtype, scale, baseline):
    """In float64, 0.7 + 0.7 + 0.7 = 2.0999999999999996 and its third 0.6999999999999998 ≠ 0.7: a
    variance from that mean is not 0 (it gave advantages of 1.1e-12 and no_signal False before).
    The second group is ordinary: its advantages are the hand values of the naive loop."""
    from lit_rlhf.core.advantages import group_advantages

    adv, no_signal = group_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 2.0, 4.0], dtype=dtype), 3, scale, baseline)
    assert no_signal.tolist() == [True, False]
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # exactly
    expected = naive_group_advantages([1.0, 2.0, 4.0], 3, scale, baseline == "leave_one_out")
    assert adv[3:].tolist() == pytest.approx(expected, rel=1e-6)


def test_rewards_equal_up_to_rounding_are_no_signal_and_a_real_difference_is_kept():
    """docs/algorithms.md §6: equal up to rounding = max − min ≤ 4 ε · max|r|, ε of the rewards' dtype."""
    from lit_rlhf.core.advantages import group_advantages

    # float64: 0.1 + 0.2 = 0.30000000000000004, one unit of rounding (2**-54) above 0.3
    assert (0.1 + 0.2) - 0.3 == 2**-54
    adv, no_signal = group_advantages(torch.tensor([0.1 + 0.2, 0.3, 0.3], dtype=torch.float64), 3)
    assert no_signal.tolist() == [True] and adv.tolist() == [0.0, 0.0, 0.0]
    # float32: both round to the same float32 (0.30000001192092896): exactly equal
    as32 = torch.tensor([0.1 + 0.2, 0.3, 0.3], dtype=torch.float32)
    assert as32[0].item() == as32[1].item() == 0.30000001192092896
    adv, no_signal = group_advantages(as32, 3)
    assert no_signal.tolist() == [True] and adv.tolist() == [0.0, 0.0, 0.0]
    # float32 at 1.0 (ε = 2**-23): 2 units apart is rounding, 8 units apart is a signal;
    # scale=False, mean baseline: ± half the gap, 2**-21
    adv, no_signal = group_advantages(torch.tensor([1.0, 1.0 + 2**-22, 1.0, 1.0 + 2**-20]), 2, scale=False)
    assert no_signal.tolist() == [True, False]
    assert adv.tolist() == [0.0, 0.0, -(2**-21), 2**-21]
    # float64: 1e-9 apart at 0.3 is a signal (far above 4 ε · 0.3 = 2.7e-16)
    r = [0.3, 0.3 + 1e-9, 0.3]
    adv, no_signal = group_advantages(torch.tensor(r, dtype=torch.float64), 3, scale=False)
    mean = sum(r) / 3
    assert no_signal.tolist() == [False] and adv.tolist() == pytest.approx([x - mean for x in r], rel=1e-6, abs=0)


@pytest.mark.parametrize("scale", [False, True])
def test_leave_one_out_with_one_finite_reward_gives_advantage_zero(scale):
    """RLOO: a group with one finite reward has no other sample for a baseline (it used to get its raw
    reward 2.0 as advantage, or 2.0 / 1e-4 scaled); flagged no signal, every member gets 0. The
    second group [5, 1, -inf]: baselines 1 and 5, advantages ±4 (÷ (stdev(5, 1) = √8) + 1e-4 scaled)."""
    from lit_rlhf.core.advantages import group_advantages

    rewards = torch.tensor([2.0, float("nan"), float("inf"), 5.0, 1.0, float("-inf")])
    adv, no_signal = group_advantages(rewards, 3, scale, "leave_one_out")
    assert no_signal.tolist() == [True, False]
    d = 8**0.5 + 1e-4 if scale else 1.0
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, 4.0 / d, -4.0 / d, 0.0], rel=1e-6)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # exactly


# ---------------------------------------------------------------- REINFORCE++ and ReMax (§6.1, §6.2)


def naive_kl_shaped(scores, baselines, kl, lengths, beta, gamma=1.0):
    """The papers' per-token advantage, row by row in float64: REINFORCE++ (Hu 2025, Eq. for
    A_{q,o_t}) and ReMax (Li et al. 2023) with the KL in the reward, A_t = Σ_{s ≥ t} γ^{s−t} R_s,
    R_s = −β kl_s + (r − b)·1[s = L]; for γ = 1: A_t = r − b − β Σ_{s=t}^{L} kl_s."""
    out = [[0.0] * len(kl[0]) for _ in kl]
    for i, n in enumerate(lengths):
        for t in range(n):
            total = 0.0
            for s in range(t, n):
                reward = -beta * kl[i][s] + ((scores[i] - baselines[i]) if s == n - 1 else 0.0)
                total += gamma ** (s - t) * reward
            out[i][t] = total
    return out


def naive_whiten(adv, lengths):
    """(A − mean) / sqrt(var + 1e-8) over every response token of the batch (Bessel-corrected var)."""
    import statistics

    tokens = [adv[i][t] for i, n in enumerate(lengths) for t in range(n)]
    mean, var = statistics.mean(tokens), statistics.variance(tokens)
    return [
        [(a - mean) / (var + 1e-8) ** 0.5 if t < n else 0.0 for t, a in enumerate(row)] for row, n in zip(adv, lengths)
    ]


def random_batch(seed, lengths, width):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    scores = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    kl = torch.randn(len(lengths), width, generator=g, dtype=torch.float64) * mask
    return scores, kl, mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_rewards_to_go_match_the_naive_loop_and_ignore_padding(gamma):
    from lit_rlhf.core.advantages import rewards_to_go

    lengths = [4, 1, 6, 3]
    _, rewards, mask = random_batch(1, lengths, 6)
    expected = [
        [sum(gamma ** (s - t) * rewards[i, s].item() for s in range(t, n)) if t < n else 0.0 for t in range(6)]
        for i, n in enumerate(lengths)
    ]
    torch.testing.assert_close(rewards_to_go(rewards, mask, gamma), torch.tensor(expected, dtype=torch.float64))
    poisoned = torch.where(mask.bool(), rewards, torch.tensor(float("nan"), dtype=torch.float64))
    torch.testing.assert_close(rewards_to_go(poisoned, mask, gamma), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("whiten", [False, True])
def test_reinforce_pp_advantages_match_the_paper_formula(whiten, gamma):
    """REINFORCE++ (b = 0): the KL-shaped return of every token, normalized over the WHOLE batch."""
    from lit_rlhf.core.advantages import reinforce_advantages

    lengths = [5, 1, 7, 3, 7]
    scores, kl, mask = random_batch(2, lengths, 7)
    adv, rewards = reinforce_advantages(scores, kl, mask, 0.3, whiten=whiten, gamma=gamma)
    expected = naive_kl_shaped(scores.tolist(), [0.0] * 5, kl.tolist(), lengths, 0.3, gamma)
    if whiten:
        expected = naive_whiten(expected, lengths)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    # the shaped reward: −β kl on each token, the score on the last one (PPO's shape_rewards)
    assert rewards[0, 4].item() == pytest.approx(scores[0].item() - 0.3 * kl[0, 4].item())
    assert rewards[0, 2].item() == pytest.approx(-0.3 * kl[0, 2].item()) and rewards[1, 1:].abs().sum() == 0
    if whiten:  # mean 0, Bessel variance 1 over the response tokens
        tokens = adv[mask.bool()]
        # (masked_whiten takes its moments in float32)
        assert tokens.mean().item() == pytest.approx(0.0, abs=1e-6) and tokens.var().item() == pytest.approx(
            1.0, rel=1e-5
        )


def test_reinforce_pp_baseline_is_the_group_mean_subtracted_before_the_shaping_and_the_batch_normalization():
    """REINFORCE++-baseline (OpenRLHF's ``reinforce_baseline``): r − mean of its prompt's group, then the
    KL shaping, the return-to-go and the whole-batch normalization, in that order."""
    import statistics

    from lit_rlhf.core.advantages import group_advantages, reinforce_advantages

    lengths = [3, 6, 2, 6, 4, 1, 5, 6]  # 2 groups of 4
    scores, kl, mask = random_batch(3, lengths, 6)
    centred, _ = group_advantages(scores, 4, scale=False, baseline="mean")
    adv, _ = reinforce_advantages(centred, kl, mask, 0.1, whiten=True)
    s = scores.tolist()
    means = [statistics.mean(s[:4])] * 4 + [statistics.mean(s[4:])] * 4
    expected = naive_whiten(naive_kl_shaped(s, means, kl.tolist(), lengths, 0.1), lengths)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_remax_advantages_match_the_paper_and_verl():
    """ReMax: A_t = r(y) − r(ȳ_greedy) − β Σ_{s≥t} kl_s, not normalized; verl's
    ``compute_remax_outcome_advantage`` writes it as (reverse cumsum of the token rewards) − b."""
    from lit_rlhf.core.advantages import reinforce_advantages
    from lit_rlhf.core.shaping import shape_rewards

    lengths = [2, 5, 5, 1]
    scores, kl, mask = random_batch(4, lengths, 5)
    greedy = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    adv, _ = reinforce_advantages(scores, kl, mask, 0.05, baseline=greedy)
    expected = naive_kl_shaped(scores.tolist(), greedy.tolist(), kl.tolist(), lengths, 0.05)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    token_rewards = shape_rewards(scores, kl, mask, 0.05)  # verl: token_level_rewards with the KL in the reward
    verl = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1) - greedy[:, None] * mask
    torch.testing.assert_close(adv, verl)


def test_kl_shaped_advantages_hand_values():
    """Two rows: L = 2 with kl [0.5, 0.25], r = 1, and L = 1 with kl [1], r = 0.5; β = 0.5.
    Returns: row 0 [1 − 0.5·0.75, 1 − 0.5·0.25] = [0.625, 0.875]; row 1 [0.5 − 0.5] = [0].
    Whitened: mean 0.5, deviations [0.125, 0.375, −0.5], Bessel variance 0.40625 / 2 = 0.203125.
    ReMax with greedy scores [0.25, 0.5]: row 0 [0.375, 0.625], row 1 [−0.5]."""
    from lit_rlhf.core.advantages import reinforce_advantages

    scores, mask = torch.tensor([1.0, 0.5]), torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[0.5, 0.25], [1.0, 7.0]])  # 7.0: padding, never read
    adv, rewards = reinforce_advantages(scores, kl, mask, 0.5)
    assert adv.tolist() == [[0.625, 0.875], [0.0, 0.0]] and rewards.tolist() == [[-0.25, 0.875], [0.0, 0.0]]
    adv, _ = reinforce_advantages(scores, kl, mask, 0.5, whiten=True)
    sd = (0.203125 + 1e-8) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.125 / sd, 0.375 / sd], [-0.5 / sd, 0.0]]))
    adv, _ = reinforce_advantages(scores, kl, mask, 0.5, baseline=torch.tensor([0.25, 0.5]))
    assert adv.tolist() == [[0.375, 0.625], [-0.5, 0.0]]
    # REINFORCE++-baseline on a group [1, 3] (centred [−1, 1]), β = 0: tokens [−1, −1, 1], mean −1/3,
    # Bessel variance (4/9 + 4/9 + 16/9) / 2 = 4/3
    adv, _ = reinforce_advantages(torch.tensor([-1.0, 1.0]), kl, mask, 0.0, whiten=True)
    sd = (4 / 3 + 1e-8) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([[-2 / 3 / sd, -2 / 3 / sd], [4 / 3 / sd, 0.0]]))


def test_without_kl_and_normalization_the_advantage_is_the_sequence_advantage_on_every_token():
    """β = 0, no whitening: exactly GRPO's broadcast r − b (the group path runs through the same function)."""
    from lit_rlhf.core.advantages import reinforce_advantages

    lengths = [3, 1, 4]
    scores, kl, mask = random_batch(5, lengths, 4)
    adv, _ = reinforce_advantages(scores.float(), torch.zeros(3, 4), mask, 0.0)
    assert torch.equal(adv, scores.float()[:, None] * mask)
