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


from lit_rlhf.core.logprobs import entropy_from_logits  # noqa: E402
from lit_rlhf.core.losses import aggregate, ppo_policy_loss, value_loss  # noqa: E402


def test_policy_loss_hand_values():
    # token 0: A=1, ratio=1.5 -> clipped at 1.2: max(-1.5, -1.2) = -1.2 (clipped)
    # token 1: A=-1, ratio=0.5 -> max(0.5, 0.8) = 0.8 (clipped); token 2 masked out
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.5, 0.5, 3.0]]))
    adv = torch.tensor([[1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = ppo_policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clipfrac"].item() == 1.0 and stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["approx_kl"].item() == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2)


def test_policy_loss_clip_higher_and_dual_clip():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.25, 4.0]]))
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # ε_high 0.28: ratio 1.25 is inside, unclipped -1.25; token 1: max(4, 1.28)=4
    loss, _ = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.25 + 4.0) / 2)
    # dual clip c=3 caps the negative-advantage token at -c·A = 3
    loss, stats = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.25 + 3.0) / 2) and stats["dual_clipfrac"].item() == 0.5


def test_policy_loss_matches_naive_loop_and_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 4, generator=g) * 0.3).requires_grad_()
    old = torch.randn(3, 4, generator=g) * 0.3
    adv = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    loss, _ = ppo_policy_loss(lp, old, adv, mask, 0.2, 0.3)
    total, n = 0.0, 0
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                r = math.exp(lp[b, t].item() - old[b, t].item())
                a = adv[b, t].item()
                total += max(-a * r, -a * min(max(r, 0.8), 1.3))
                n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-5)
    loss.backward()
    # gradient is -A·ρ/N where unclipped is active, 0 where the clipped branch is
    r = torch.exp(lp.detach() - old)
    active = (-adv * r >= -adv * r.clamp(0.8, 1.3)) & mask.bool()
    expected = torch.where(active, -adv * r / n, torch.zeros_like(r))
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-5)


def test_value_loss_hand_values():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    ret = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 0: unclipped (1-0)^2 = 1, clipped v = 0.7 -> 0.49; max = 1. token 1: (0-1)^2 = 1 both
    loss, stats = value_loss(v, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert stats["clipfrac"].item() == 0.0
    # clipped branch dominates when V moved away from G: v=-1, old=0 -> clip to -0.2: (−0.2−1)²=1.44 < 4
    loss, stats = value_loss(
        torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2
    )
    assert loss.item() == pytest.approx(0.5 * 4.0) and stats["clipfrac"].item() == 0.0
    loss, stats = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.5 * 4.0)
    # no clip: plain MSE
    loss, _ = value_loss(v, old, ret, mask, clip=None)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    # the clipped term is the larger one when V overshot G from V_old: old 0, V 2, G 1.5 ->
    # unclipped (2 − 1.5)² = 0.25, clipped V = 0.2 -> (0.2 − 1.5)² = 1.69: loss ½·1.69, no gradient
    # (the clamp is saturated); token 2 (V 0.1 inside the band, G 0) is masked out
    v = torch.tensor([[2.0, 0.1]], requires_grad=True)
    loss, stats = value_loss(v, torch.tensor([[0.0, 0.0]]), torch.tensor([[1.5, 0.0]]), torch.tensor([[1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(0.5 * 1.69) and stats["clipfrac"].item() == 1.0
    loss.backward()
    assert v.grad.tolist() == [[0.0, 0.0]]
    unclipped, _ = value_loss(
        torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[1.5]]), torch.ones(1, 1), None
    )
    assert unclipped.item() == pytest.approx(0.5 * 0.25)


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    _, perfect = value_loss(ret, ret, ret, torch.ones(1, 4))
    assert perfect["explained_variance"].item() == pytest.approx(1.0)
    _, const = value_loss(ret, torch.full((1, 4), 2.5), ret, torch.ones(1, 4))
    assert const["explained_variance"].item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_matches_naive():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g) * 3
    p = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=2), -(p * p.log()).sum(-1))
    uniform = entropy_from_logits(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8))


def test_aggregations():
    x = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, m, "token_mean").item() == pytest.approx(2.0)  # (1+3+2)/3
    assert aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate(x, m, "seq_sum_constant", constant=4).item() == pytest.approx(6 / (2 * 4))


def test_entropy_loss_bonus_and_target_forms():
    from lit_rlhf.core.losses import entropy_loss

    h = torch.tensor([[1.0, 3.0, 9.0]])
    m = torch.tensor([[1, 1, 0]])
    loss, stats = entropy_loss(h, m, coef=0.1)
    assert stats["entropy"].item() == 2.0 and loss.item() == pytest.approx(-0.2)
    loss, _ = entropy_loss(h, m, coef=0.1, target=2.5)
    assert loss.item() == pytest.approx(0.05)


def test_ptx_loss_is_token_mean_nll():
    from lit_rlhf.core.losses import ptx_loss

    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.5, 1.0, 1.0]]))
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = ptx_loss(lp, m)
    assert loss.item() == pytest.approx((math.log(2) + math.log(4) + math.log(2)) / 3)


def _naive_dpo(pc, pr, rc, rr, beta, kind, s=0.0):
    """Per pair, in plain Python floats (docs/algorithms.md §5)."""
    out = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        u = (a - c) - (b - d)
        logsig = lambda z: -math.log1p(math.exp(-z))  # noqa: E731
        if kind == "sigmoid":
            out.append(-(1 - s) * logsig(beta * u) - s * logsig(-beta * u))
        else:
            out.append((u - 1 / (2 * beta)) ** 2)
    return sum(out) / len(out)


def test_dpo_losses_hand_values():
    from lit_rlhf.core.losses import dpo_sigmoid_loss, ipo_loss

    # u = (-1 - -2) - (-3 - -2.5) = 1.5; β = 0.5 → β·u = 0.75
    args = [torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5])]
    loss, stats = dpo_sigmoid_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.75)))
    assert (stats["chosen_rewards"].item(), stats["rejected_rewards"].item()) == pytest.approx((0.5, -0.25))
    cdpo, _ = dpo_sigmoid_loss(*args, beta=0.5, label_smoothing=0.2)
    assert cdpo.item() == pytest.approx(0.8 * math.log1p(math.exp(-0.75)) + 0.2 * math.log1p(math.exp(0.75)))
    ipo, _ = ipo_loss(*args, beta=0.5)
    assert ipo.item() == pytest.approx((1.5 - 1.0) ** 2)  # (u - 1/(2β))², 1/(2·0.5) = 1


@pytest.mark.parametrize("kind, s", [("sigmoid", 0.0), ("sigmoid", 0.3), ("ipo", 0.0)])
def test_dpo_losses_match_the_naive_formula(kind, s):
    from lit_rlhf.core.objectives import PAIR_LOSSES

    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(16, generator=g, dtype=torch.float64) * 5 - 20 for _ in range(4))
    extra = {"label_smoothing": s} if kind == "sigmoid" else {}
    loss, _ = PAIR_LOSSES[kind].fn(pc, pr, rc, rr, beta=0.1, **extra)
    assert loss.item() == pytest.approx(_naive_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), 0.1, kind, s))


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    from lit_rlhf.core.losses import dpo_sigmoid_loss

    pc, pr = torch.tensor([-5.0], requires_grad=True), torch.tensor([-5.0], requires_grad=True)
    loss, _ = dpo_sigmoid_loss(pc, pr, torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.1)
    loss.backward()
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)  # ±β·σ(0) = ±0.05


def test_aggregations_against_hand_values():
    from lit_rlhf.core.losses import aggregate

    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # DAPO: every token equal
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(
        (2.0 + 4.0) / 2
    )  # GRPO: each sequence equal
    assert aggregate(loss, mask, "seq_sum_constant", constant=8).item() == pytest.approx(10 / (2 * 8))  # Dr. GRPO


def test_clip_higher_and_the_side_that_clipped():
    """ε_low 0.2, ε_high 0.28: a positive advantage stops gaining at ρ = 1.28 (not 1.2); the clip
    fractions say which bound binds."""
    lp_old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.25, 1.3, 0.7, 0.9]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = ppo_policy_loss(ratio.log(), lp_old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(−A ρ, −A clip(ρ)): −1.25 (inside), −1.28 (clipped high), 0.8 (clipped low: −(−1)·0.8), 0.9
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 0.9) / 4)
    assert (stats["clipfrac_high"].item(), stats["clipfrac_low"].item()) == (0.25, 0.25)
    symmetric, _ = ppo_policy_loss(ratio.log(), lp_old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 0.9) / 4)


def test_seq_mean_counts_a_row_without_tokens_as_zero():
    """docs/algorithms.md §6, as TRL's GRPO: ((l·m).sum(-1) / m.sum(-1).clamp(min=1)).mean(): every
    row is one of the B, a row without tokens (a response left out: no finite reward) adds 0."""
    from lit_rlhf.core.losses import aggregate

    loss = torch.tensor([[1.0, 3.0], [9.0, 9.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 0.0 + 5.0) / 3)
    rows = [sum(x * m for x, m in zip(lr, mr)) / max(sum(mr), 1) for lr, mr in zip(loss.tolist(), mask.tolist())]
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(sum(rows) / len(rows))


def test_the_objective_tables_name_functions_that_exist_and_the_configs_take_their_names():
    """Every entry of lit_rlhf/core/objectives.py points at a function of core/losses.py, each
    aggregation name is one ``aggregate`` computes, and a config refuses a name no table has."""
    import inspect

    from lit_rlhf.core.losses import aggregate
    from lit_rlhf.core.objectives import AGGREGATIONS, PAIR_LOSSES, POLICY_LOSSES
    from lit_rlhf.modules.configs import DPOConfig, PPOConfig
    from lit_rlhf.utils.config import ConfigError, build_config
    from tests.helpers.presets import preset

    for name, entry in PAIR_LOSSES.items():
        params = inspect.signature(entry.fn).parameters
        assert set(entry.params) <= set(params), name  # the algo.* values it takes are its keywords
        assert all(hasattr(DPOConfig, p) for p in entry.params), name
    common = list(inspect.signature(POLICY_LOSSES["clip"].fn).parameters)
    for name, entry in POLICY_LOSSES.items():  # every objective is called the same way (modules/rl.py)
        params = list(inspect.signature(entry.fn).parameters)
        assert params[: len(common)] == common, name
    x, m = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 1], [1, 0]])
    for name in AGGREGATIONS:
        assert torch.isfinite(aggregate(x, m, name, 2.0))
    with pytest.raises(ValueError) as unknown:  # aggregate implements exactly the table's names
        aggregate(x, m, "sum")
    assert str(unknown.value).endswith(f"one of {', '.join(AGGREGATIONS)}")
    with pytest.raises(
        ConfigError, match=r"algo.loss_type: must be one of \['sigmoid', 'ipo', 'simpo', 'orpo', 'kto'\]"
    ):
        build_config(DPOConfig, preset("dpo", loss_type="hinge"), "algo")
    with pytest.raises(ConfigError, match=r"algo.loss_aggregation: must be one of \['token_mean'"):
        build_config(PPOConfig, preset("ppo", reward_path="/rm", loss_aggregation="sum"), "algo")
    with pytest.raises(ConfigError, match=r"algo.policy_loss: must be one of \['clip', 'gspo', 'gspo_token'"):
        build_config(PPOConfig, preset("ppo", reward_path="/rm", policy_loss="sapo"), "algo")
    with pytest.raises(ConfigError, match="algo.label_smoothing: applies to the sigmoid and simpo losses only"):
        build_config(DPOConfig, preset("dpo", loss_type="ipo", label_smoothing=0.1), "algo")
