"""Losses; each returns ``(loss, stats)`` with stats detached (docs/architecture.md "Conventions").

Reward model (docs/algorithms.md §1), PPO policy / value / entropy / ptx terms (§2), the DPO
family (§5: DPO, cDPO, IPO; SimPO §5.1, ORPO §5.2, KTO §5.3), and the token aggregation shared
with GRPO (§6). Which config name selects which of them, and what each reads, is the tables of
lit_rlhf/core/objectives.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_rlhf.core.masked import masked_mean, masked_sum, zero_outside


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    constant: float | None = None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar; padded positions never enter it, nor its gradient.

    token_mean: Σ m·l / Σ m (PPO, DAPO); seq_mean_token_mean: (1/B) Σ_i of row i's token mean, a row
    without tokens counting as 0 in the B (original GRPO, as TRL; docs/algorithms.md §6);
    seq_sum_constant: Σ m·l / (B · constant) (Dr. GRPO; constant = max length). The config's names
    (``algo.loss_aggregation``) are :data:`lit_rlhf.core.objectives.AGGREGATIONS`; a test holds the two
    to the same three.

    ``normalizer`` replaces this batch's own count (Σ m for token_mean, B for the two others) when
    the batch is one shard of a larger one: the global count over the number of processes whose
    gradients are averaged, so that the averaged gradient is the global batch's whatever the
    sharding (docs/algorithms.md §6, "Normalisation over the global batch").
    """
    if mode == "token_mean":
        if normalizer is None:
            return masked_mean(per_token, mask)
        return masked_sum(per_token, mask) / normalizer
    if mode == "seq_mean_token_mean":
        rows = masked_mean(per_token, mask, dim=1)
        return rows.mean() if normalizer is None else rows.sum() / normalizer
    if mode == "seq_sum_constant":
        if not constant:
            raise ValueError("seq_sum_constant needs a constant normaliser (e.g. max_new_tokens)")
        count = per_token.shape[0] if normalizer is None else normalizer
        return masked_sum(per_token, mask) / (count * constant)
    raise ValueError(f"unknown aggregation {mode!r}; one of token_mean, seq_mean_token_mean, seq_sum_constant")


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    agg_constant: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate (Schulman et al. 2017, Eq. 7), per token, ρ_t = exp(logp − logp_old):

    l_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high)); with dual clip c > 1 (Ye et al.
    2020, Eq. 5) tokens with A_t < 0 are also capped at −c·A_t. ε_high > ε_low is DAPO's
    clip-higher. With ``is_weights`` w_t (truncated importance sampling of a mismatched sampler,
    core/mismatch.py) each token's term is w_t·l_t.

    Args:
        logprobs, old_logprobs, advantages, response_mask: (B, T); whatever the first three hold
            outside the mask (inf, NaN) reaches neither the loss nor the gradient.
        is_weights: (B, T) detached per-token weights, or None (= 1).
        normalizer: the aggregation's count when this batch is one shard of the step's (``aggregate``).
    Returns:
        loss, stats {"loss", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean", "ratio_max",
        "dual_clipfrac"}.
    """
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    if is_weights is not None:
        per_token = per_token * zero_outside(is_weights.detach(), response_mask)
    loss = aggregate(per_token, response_mask, aggregation, agg_constant, normalizer)
    with torch.no_grad():
        m = response_mask.bool()
        stats = {
            "loss": loss.detach(),
            "clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            # which side clipped: the ratio left [1 − ε_low, 1 + ε_high] where the clip binds
            "clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).float(), response_mask),
            "clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).float(), response_mask),
            # k3 of KL(old ‖ new) (http://joschu.net/blog/kl-approx.html)
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_max": ratio[m].max() if m.any() else ratio.new_tensor(1.0),
            "dual_clipfrac": masked_mean(dual.float(), response_mask),
        }
    return loss, stats


def _ratio_stats(
    loss: Tensor,
    ratio: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    low: float,
    high: float,
    clipped: Tensor,
) -> dict[str, Tensor]:
    """The statistics every ratio-based objective logs under the same names as ``ppo_policy_loss``:
    ``ratio`` is the (B, T) ratio the clip reads (per token, or a response's broadcast to its tokens),
    ``clipped`` (B, T) bool where the clip took effect, [``low``, ``high``] the ratio's clip range."""
    with torch.no_grad():
        m = response_mask.bool()
        return {
            "loss": loss.detach(),
            "clipfrac": masked_mean(clipped.float(), response_mask),
            "clipfrac_low": masked_mean(((ratio < low) & (advantages < 0)).float(), response_mask),
            "clipfrac_high": masked_mean(((ratio > high) & (advantages > 0)).float(), response_mask),
            "approx_kl": masked_mean((torch.exp(log_ratio) - 1.0) - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_max": ratio[m].max() if m.any() else ratio.new_tensor(1.0),
            "dual_clipfrac": torch.zeros((), device=ratio.device),
        }


def _no_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"{name} has no dual clip (algo.dual_clip must be null)")


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    aggregation: str = "seq_mean_token_mean",
    agg_constant: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: Tensor | float | None = None,
    token_level: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, Eq. 5–7; docs/algorithms.md §6.3): the ratio of a whole response,
    s_i = exp((1/|y_i|) Σ_t (ℓ_θ,t − ℓ_old,t)), in PPO's clipped surrogate per response,
    l_i = max(−A_i s_i, −A_i clip(s_i, 1 − ε_low, 1 + ε_high)).

    Written per token: every token of response i carries l_{i,t} = max(−A_{i,t} s_i, −A_{i,t} clip(s_i))
    (= l_i where the advantage is one per response, the critic-free stages), so ``seq_mean_token_mean``
    is the paper's (1/G) Σ_i l_i. ``token_level`` is GSPO-token (Eq. 13): s_{i,t} = sg[s_i] ·
    π_θ(y_t)/sg[π_θ(y_t)] has the value s_i and each token's own gradient, for per-token advantages;
    with one advantage per response both variants have the same value and gradient.
    ``is_weights`` (B, T), detached, multiply each token's term as in ``ppo_policy_loss``.
    """
    _no_dual_clip("gspo", dual_clip)
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=1).unsqueeze(1)  # (B, 1)
    if token_level:
        seq_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = zero_outside(torch.exp(seq_log_ratio.expand_as(logprobs)), response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * zero_outside(is_weights.detach(), response_mask)
    loss = aggregate(per_token, response_mask, aggregation, agg_constant, normalizer)
    stats = _ratio_stats(
        loss, ratio, log_ratio, advantages, response_mask, 1 - clip_low, 1 + clip_high, clipped > unclipped
    )
    return loss, stats


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    agg_constant: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, MiniMax 2025, Eq. 4; docs/algorithms.md §6.3): the clipped importance
    weight, stop-gradient, times the log-probability, so a token whose ratio left the clip range
    keeps its gradient (PPO's clip drops it):

    l_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · ℓ_θ,t,   ρ_t = exp(ℓ_θ,t − ℓ_old,t).

    ε_low = 1 is "no lower bound" (the paper's choice). Its gradient −ŵ_t A_t ∇ℓ_θ,t equals the
    plain policy gradient where ρ = 1. ``is_weights`` (B, T), detached, multiply each token's term.
    """
    _no_dual_clip("cispo", dual_clip)
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * advantages * logprobs
    if is_weights is not None:
        per_token = per_token * zero_outside(is_weights.detach(), response_mask)
    loss = aggregate(per_token, response_mask, aggregation, agg_constant, normalizer)
    truncated = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    stats = _ratio_stats(loss, ratio, log_ratio, advantages, response_mask, 1 - clip_low, 1 + clip_high, truncated)
    return loss, stats


def gmpo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 1.0 - math.exp(-0.4),
    clip_high: float = math.exp(0.4) - 1.0,
    dual_clip: float | None = None,
    aggregation: str = "seq_mean_token_mean",
    agg_constant: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, Eq. 7; docs/algorithms.md §6.3): the geometric mean of the token
    ratios, clipped per token in log space, with the advantage of the response:

    r̄_i = exp(sgn(A_i) · (1/|y_i|) Σ_t min(sgn(A_i) δ_t, sgn(A_i) clip(δ_t, log(1 − ε_low), log(1 + ε_high)))),
    l_i = −A_i r̄_i,   δ_t = ℓ_θ,t − ℓ_old,t.

    The pessimistic side of each token's clip, as in PPO; the defaults are the paper's range
    (e^−0.4, e^0.4). A_i is the response's advantage (the mean of its tokens': one value per
    response in the critic-free stages). Written per token (each token of row i carries l_i), so
    ``seq_mean_token_mean`` is the paper's (1/G) Σ_i l_i. ``is_weights`` multiply each token's term.
    """
    _no_dual_clip("gmpo", dual_clip)
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs
    seq_adv = masked_mean(advantages, response_mask, dim=1).unsqueeze(1)  # (B, 1)
    sign = torch.sign(seq_adv)
    bounded = log_ratio.clamp(math.log(1.0 - clip_low) if clip_low < 1.0 else -math.inf, math.log(1.0 + clip_high))
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_ratio = torch.exp(masked_mean(pessimistic, response_mask, dim=1)).unsqueeze(1)  # (B, 1)
    per_token = zero_outside((-seq_adv * seq_ratio).expand_as(logprobs), response_mask)
    if is_weights is not None:
        per_token = per_token * zero_outside(is_weights.detach(), response_mask)
    loss = aggregate(per_token, response_mask, aggregation, agg_constant, normalizer)
    ratio = torch.exp(log_ratio)
    clipped = sign * bounded < sign * log_ratio  # the pessimistic side is the bound
    advantages = seq_adv.expand_as(logprobs)
    stats = _ratio_stats(loss, ratio, log_ratio, advantages, response_mask, 1 - clip_low, 1 + clip_high, clipped)
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip: float | None = 0.2,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ½ · token mean of max((V − G)², (clip(V, V_old ± ε_v) − G)²).

    Args:
        values: (B, T) current critic; old_values: (B, T) at rollout; returns: (B, T) GAE targets;
            what they hold outside ``response_mask`` reaches neither the loss nor the gradient.
        normalizer: the token count to divide by instead of this batch's own, when it is one shard
            or micro-batch of a larger one (as :func:`aggregate`'s).
    Returns:
        loss, stats {"loss", "clipfrac", "value_mean", "explained_variance"}.
    """
    values, old_values, returns = (zero_outside(x, response_mask) for x in (values, old_values, returns))
    err = (values - returns) ** 2
    if clip is not None:
        clipped_v = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped_v - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
    else:
        err_clipped = err
        per_token = err
    loss = 0.5 * aggregate(per_token, response_mask, "token_mean", normalizer=normalizer)
    with torch.no_grad():
        resid_var = masked_mean(
            (returns - old_values - masked_mean(returns - old_values, response_mask)) ** 2, response_mask
        )
        ret_var = masked_mean((returns - masked_mean(returns, response_mask)) ** 2, response_mask)
        stats = {
            "loss": loss.detach(),
            "clipfrac": masked_mean((err_clipped > err).float(), response_mask),
            "value_mean": masked_mean(values, response_mask),
            # 1 − Var[G − V_old] / Var[G]: how much of the return the rollout-time critic explained
            "explained_variance": 1.0 - resid_var / ret_var.clamp(min=1e-8),
        }
    return loss, stats


def pairwise_rm_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss of a reward model on preference pairs (docs/algorithms.md §1).

    loss = mean[−logsigmoid(r_w − r_l − margin)] + center_coef · mean[(r_w + r_l)²]

    ``logsigmoid`` (not ``log(σ + 1e-5)``) keeps the gradient exact for large gaps. The margin
    is the Llama-2 per-pair margin (0 when absent); the centering term (TRL's
    ``center_rewards_coefficient``) keeps scores near zero without changing their order.

    Args:
        chosen: (B,) scores r(x, y_w).
        rejected: (B,) scores r(x, y_l).
        margin: (B,) or None.
        center_coef: weight of the centering term.
    Returns:
        loss (scalar), stats {"bt_loss", "center_loss", "accuracy", "margin", "score_mean", "score_std"}.
    """
    diff = chosen - rejected
    shifted = diff - margin if margin is not None else diff
    bt = -F.logsigmoid(shifted).mean()
    center = ((chosen + rejected) ** 2).mean()
    loss = bt + center_coef * center if center_coef else bt
    with torch.no_grad():
        scores = torch.cat([chosen, rejected]).float()
        stats = {
            "bt_loss": bt.detach(),
            "center_loss": center.detach(),
            "accuracy": (diff > 0).float().mean(),
            "margin": diff.float().mean(),
            "score_mean": scores.mean(),
            "score_std": scores.std(unbiased=False),
        }
    return loss, stats


def entropy_loss(
    entropy: Tensor,
    response_mask: Tensor,
    coef: float,
    target: float | None = None,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Entropy regularizer to ADD to the loss (docs/algorithms.md §2).

    Plain bonus (default): −coef · token-mean H. With ``target`` (MOSS-RLHF's form, fragile):
    coef · |token-mean H − target|, pulling the entropy towards the target from either side.

    Args:
        entropy: (B, T) per-token entropies H(π(·|s_t)).
        normalizer: the plain bonus's token count instead of this batch's own (as :func:`aggregate`'s).
            The target form is not linear in the batch's tokens, so it cannot be split: it takes none.
    """
    if target is not None:
        if normalizer is not None:
            raise ValueError("the entropy target's |mean H − target| cannot be split over shards: no normalizer")
        mean_h = masked_mean(entropy, response_mask)
        loss = coef * (mean_h - target).abs()
    else:
        mean_h = aggregate(entropy, response_mask, "token_mean", normalizer=normalizer)
        loss = -coef * mean_h
    return loss, {"entropy": mean_h.detach(), "loss": loss.detach()}


def ptx_loss(
    logprobs: Tensor, loss_mask: Tensor, normalizer: Tensor | float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-ptx (InstructGPT, Ouyang et al. 2022, Eq. 2): token-mean NLL of the policy on
    pretraining/SFT tokens, to be weighted by c_ptx.

    Args:
        logprobs: (B, T) log π(x_t | x_<t) of the batch's tokens; loss_mask: (B, T) tokens scored.
        normalizer: the token count instead of this batch's own (as :func:`aggregate`'s).
    """
    loss = -aggregate(logprobs, loss_mask, "token_mean", normalizer=normalizer)
    return loss, {"loss": loss.detach()}


def _implicit_rewards(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """u = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x)) per pair, and the
    implicit rewards β·(log π − log π_ref) of both responses (detached)."""
    chosen_logratio = chosen_logps - ref_chosen_logps
    rejected_logratio = rejected_logps - ref_rejected_logps
    rewards = {
        "chosen_rewards": (beta * chosen_logratio).detach(),
        "rejected_rewards": (beta * rejected_logratio).detach(),
    }
    return chosen_logratio - rejected_logratio, rewards


def dpo_sigmoid_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023, Eq. 7; docs/algorithms.md §5) on sequence log-probs of the
    response tokens, with u the log-ratio difference of :func:`_implicit_rewards`: −log σ(β·u);
    with label smoothing s (cDPO, Mitchell 2023, Eq. 3): −(1 − s)·log σ(β·u) − s·log σ(−β·u).

    Args:
        chosen_logps, rejected_logps: (B,) log π_θ of y_w and y_l (summed over response tokens).
        ref_chosen_logps, ref_rejected_logps: (B,) the same under the frozen reference.
    Returns:
        loss (mean over pairs), stats {"loss", "chosen_rewards" (B,), "rejected_rewards" (B,)}
        with the implicit rewards β·(log π − log π_ref) per pair.
    """
    u, rewards = _implicit_rewards(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * u) - label_smoothing * F.logsigmoid(-beta * u)
    loss = losses.mean()
    return loss, {"loss": loss.detach(), **rewards}


def ipo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO (Azar et al. 2023, Eq. 17; docs/algorithms.md §5): (u − 1/(2β))², u as in
    :func:`dpo_sigmoid_loss` — a squared loss that does not push u to infinity. Same arguments and
    stats as :func:`dpo_sigmoid_loss`."""
    u, rewards = _implicit_rewards(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    loss = ((u - 1.0 / (2.0 * beta)) ** 2).mean()
    return loss, {"loss": loss.detach(), **rewards}


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − eˣ) for x ≤ 0, accurate at both ends (Mächler 2012, "Accurately computing log(1 − exp(−|a|))"):
    log(−expm1(x)) above −ln 2, log1p(−eˣ) below. Naive equivalent: ``torch.log1p(-torch.exp(x))``
    (what TRL's ORPO computes), which is −inf, and its gradient NaN, once eˣ rounds to 1 (x > −6e-8 in fp32).
    Each branch only ever sees its own range, so neither leaks an inf into the other's gradient."""
    cut = -math.log(2.0)
    near = x > cut
    at_cut = torch.full_like(x, cut)
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, at_cut))),
        torch.log1p(-torch.exp(torch.where(near, at_cut, x))),
    )


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float,
    gamma_beta_ratio: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO (Meng et al. 2024; docs/algorithms.md §5.1), reference-free, on AVERAGE per-token
    log-probs p̄(y|x) = log π(y|x) / |y|:

    h = β·(p̄(y_w|x) − p̄(y_l|x)) − γ,  with γ = β·gamma_beta_ratio;  loss = −(1 − s)·log σ(h) − s·log σ(−h)

    (s: label smoothing as in the SimPO code and TRL's CPO trainer; s = 0 is the paper's loss).

    Args:
        chosen_avg_logps, rejected_avg_logps: (B,) mean log π_θ per response token of y_w and y_l.
    Returns:
        loss (mean over pairs), stats {"loss", "chosen_rewards" (B,), "rejected_rewards" (B,)} with the
        implicit rewards β·p̄(y|x).
    """
    h = beta * (chosen_avg_logps - rejected_avg_logps) - beta * gamma_beta_ratio
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    loss = losses.mean()
    stats = {
        "loss": loss.detach(),
        "chosen_rewards": (beta * chosen_avg_logps).detach(),
        "rejected_rewards": (beta * rejected_avg_logps).detach(),
    }
    return loss, stats


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (Hong et al. 2024; docs/algorithms.md §5.2), reference-free:

    L = L_SFT + λ·L_OR (λ = ``beta``, TRL's ``ORPOConfig.beta``),  L_SFT = mean over pairs of −p̄(y_w|x),
    L_OR = mean over pairs of −log σ(log odds(y_w|x) − log odds(y_l|x)),
    log odds(y|x) = log(P/(1 − P)) = p̄ − log(1 − e^p̄),  P(y|x) = e^p̄,

    where p̄(y|x) is the average per-token log-prob of the response (as the paper, its code and TRL).
    log(1 − e^p̄) is :func:`log1mexp` (TRL: ``log1p(-exp(p̄))``, equal where both are finite).

    Args:
        chosen_avg_logps, rejected_avg_logps: (B,) mean log π_θ per response token of y_w and y_l.
        beta: λ, the weight of the odds-ratio term.
    Returns:
        loss, stats {"loss", "nll_loss" (L_SFT), "or_loss" (L_OR), "log_odds_ratio" (−L_OR, TRL's name),
        "log_odds_chosen" (mean log-odds difference), "chosen_rewards" (B,), "rejected_rewards" (B,)}
        with the rewards λ·p̄(y|x) (TRL's).
    """
    log_odds = (chosen_avg_logps - log1mexp(chosen_avg_logps)) - (rejected_avg_logps - log1mexp(rejected_avg_logps))
    nll = -chosen_avg_logps.mean()
    odds_ratio = -F.logsigmoid(log_odds).mean()
    loss = nll + beta * odds_ratio
    stats = {
        "loss": loss.detach(),
        "nll_loss": nll.detach(),
        "or_loss": odds_ratio.detach(),
        "log_odds_ratio": -odds_ratio.detach(),
        "log_odds_chosen": log_odds.detach().mean(),
        "chosen_rewards": (beta * chosen_avg_logps).detach(),
        "rejected_rewards": (beta * rejected_avg_logps).detach(),
    }
    return loss, stats


def kto_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor, reduce=None) -> Tensor:
    """KTO's reference point (Ethayarajh et al. 2024; docs/algorithms.md §5.3):

    z_ref = max(0, mean_i [log π_θ(y'_i|x_i) − log π_ref(y'_i|x_i)])

    over MISMATCHED pairs (x_i, y'_i): each prompt with another example's completion, a biased but
    low-variance estimate of KL(π_θ ‖ π_ref). Detached: no gradient flows through it (as in the
    paper's code and TRL).

    Args:
        policy_kl_logps, ref_kl_logps: (B,) sequence log-probs of the mismatched pairs.
        reduce: optional in-place sum of a (2,) tensor over processes (``all_reduce_sum``), so the
            mean runs over every rank's pairs; None = this batch alone.
    Returns:
        () tensor z_ref ≥ 0.
    """
    with torch.no_grad():
        diff = (policy_kl_logps - ref_kl_logps).to(torch.float64)
        totals = torch.stack([diff.sum(), diff.new_tensor(float(diff.numel()))])
        if reduce is not None:
            totals = reduce(totals)
        return (totals[0] / totals[1].clamp(min=1.0)).clamp(min=0.0).to(policy_kl_logps.dtype)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    reference_point: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO (Ethayarajh et al. 2024; docs/algorithms.md §5.3) on unpaired examples. With the
    implicit reward r = log π_θ(y|x) − log π_ref(y|x) (sequence log-probs) and z = ``reference_point``:

    desirable y:   λ_D·(1 − σ(β·(r − z)));   undesirable y:   λ_U·(1 − σ(β·(z − r)))

    i.e. λ_y − v(x, y), averaged over the batch's examples.

    Args:
        logps, ref_logps: (B,) sequence log-probs under π_θ and π_ref.
        desirable: (B,) bool, True = desirable.
        reference_point: z_ref (:func:`kto_reference_point`), detached.
    Returns:
        loss, stats {"loss", "rewards" (B,) β·r, "kl" z_ref}.
    """
    r = logps - ref_logps
    good = desirable.bool()
    losses = torch.where(
        good,
        desirable_weight * (1.0 - torch.sigmoid(beta * (r - reference_point))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (reference_point - r))),
    )
    loss = losses.mean()
    stats = {
        "loss": loss.detach(),
        "rewards": (beta * r).detach(),
        "kl": torch.as_tensor(reference_point, dtype=r.dtype, device=r.device).detach(),
    }
    return loss, stats
