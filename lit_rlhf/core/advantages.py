"""Advantages: GAE over response tokens for PPO (docs/algorithms.md §2.4; Schulman et al. 2016),
group-relative advantages for the critic-free methods (§6), and the KL-shaped returns of
REINFORCE++ and ReMax (§6.1, §6.2)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lit_rlhf.core.masked import AllReduce, masked_whiten, no_all_reduce
from lit_rlhf.core.shaping import shape_rewards


def gae(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    dones: Tensor | None = None,
    next_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns of each step (a response token, or a control-task step).

    δ_t = R_t + γ (1 − d_t) V_{t+1} − V_t;   A_t = δ_t + γλ (1 − d_t) A_{t+1};   G_t = A_t + V_t.

    For language the defaults apply: no ``dones``, and V (and A) are 0 after the last response
    token. For control tasks (examples/cartpole_ppo.py) ``dones`` cut the recursion where an
    episode ended and ``next_value`` bootstraps the unfinished episode after the last column.

    The steps are the mask's ones, in order: a column outside the mask is skipped, so that t + 1 is
    the next masked column. In a multi-turn trajectory the environment's tokens sit between the
    policy's turns (docs/agents.md): the last token of a turn bootstraps from the value of the first
    token of the next one, as if the environment's reply were part of the transition.

    Args:
        rewards: (B, T) per-step rewards (shaped), 0 outside the mask.
        values: (B, T) V(s_t) at rollout time.
        response_mask: (B, T) 1 = a step to score (a single-turn response: contiguous ones from
            column 0; a multi-turn trajectory: the policy's tokens, with gaps).
        dones: (B, T) 1 where the episode ended with step t's transition (no bootstrap across it).
        next_value: (B,) V of the state after column T − 1 (0 when None).
    Returns:
        advantages (B, T), returns (B, T); both 0 where the mask is 0.

    Naive equivalent: a Python loop per row over its steps (tests compare, with and without dones).
    """
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # `where`, not `* mask`: an inf/NaN at a padded position would turn into NaN (inf·0) and
    # flow backwards through the recursion into every real token of the row
    values = torch.where(keep, values, zero)
    rewards = torch.where(keep, rewards.to(values.dtype), zero)
    mask = keep.to(values.dtype)
    nonterminal = torch.ones_like(values) if dones is None else 1.0 - dones.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(values[:, 0])
    next_v = torch.zeros_like(values[:, 0]) if next_value is None else next_value.to(values.dtype)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_v * nonterminal[:, t] - values[:, t]
        adv = (delta + gamma * lam * nonterminal[:, t] * next_adv) * mask[:, t]
        advantages[:, t] = adv
        # a column outside the mask is no step: the recursion carries over it unchanged
        next_adv = torch.where(keep[:, t], adv, next_adv)
        next_v = torch.where(keep[:, t], values[:, t], next_v)
    return advantages, (advantages + values) * mask


def rewards_to_go(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE's return of every response token, G_t = Σ_{s ≥ t} γ^{s−t} R_s (0 outside the mask).

    It is :func:`gae` with V ≡ 0 and λ = 1 (δ_t = R_t, A_t = R_t + γ A_{t+1}): the same recursion,
    so one implementation. OpenRLHF's ``get_cumulative_returns`` and the loop of verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` compute the same (tests compare a Python loop).
    """
    return gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)[0]


def reinforce_advantages(
    scores: Tensor,
    kl: Tensor,
    response_mask: Tensor,
    beta: float,
    baseline: Tensor | None = None,
    whiten: bool = False,
    all_reduce: AllReduce = no_all_reduce,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Token advantages from a sequence score and a per-token KL penalty (docs/algorithms.md §6.1–§6.2):

    R_t = −β·kl_t + (r − b)·1[t = L];   A_t = Σ_{s≥t} γ^{s−t} R_s;   whiten: Â = (A − μ)/√(σ² + 10⁻⁸)

    with L each response's last token and μ, σ² (Bessel) over the masked tokens of ALL ranks
    (``all_reduce`` sums over processes). With γ = 1: A_t = r − b − β Σ_{s≥t} kl_s.

    * REINFORCE++ (Hu 2025): b = 0, whiten; REINFORCE++-baseline: b = the group's mean score
      (here already subtracted by the caller: ``scores`` = r − mean_group r), whiten. OpenRLHF's
      ``compute_advantages_and_returns`` does the same steps in the same order (baseline, then
      ``compute_reward``'s KL shaping, then ``get_cumulative_returns``, then the batch
      normalization); its variance divides by n, not n − 1 (a factor √(n/(n−1)) on Â), and
      clamps it at 10⁻⁸; verl's ``masked_whiten`` is this one (Bessel, + 10⁻⁸).
    * ReMax (Li et al. 2023): b = the score of the greedy response to the same prompt, no
      whitening: verl's ``compute_remax_outcome_advantage`` (returns − b on every token).
    * β = 0, no whitening, γ = 1: r − b on every token (GRPO's broadcast sequence advantage).

    Args:
        scores: (B,) r (finite; a caller zeroes the rows it skips).
        kl: (B, T) per-token KL estimates (ignored where β = 0).
        response_mask: (B, T) 1 = response token (contiguous from column 0).
        baseline: (B,) b, or None (0).
    Returns:
        advantages (B, T) and the shaped rewards R (B, T); both 0 outside the mask.
    Naive equivalent: per row, a Python loop over its tokens from the last (tests compare, float64).
    """
    r = scores if baseline is None else scores - baseline
    rewards = shape_rewards(r, kl, response_mask, beta)
    advantages = rewards_to_go(rewards, response_mask, gamma)
    if whiten:
        advantages = masked_whiten(advantages, response_mask, all_reduce=all_reduce)
    return advantages, rewards


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: bool = True,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    eps: float = 1e-4,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Critic-free advantages of G responses per prompt (docs/algorithms.md §6), one per response.

    ``rewards`` (N,) holds N / G consecutive groups. baseline "mean": A_i = r_i − mean_group
    (GRPO; Shao et al. 2024); "leave_one_out": A_i = r_i − mean_{j≠i} r_j (RLOO; Ahmadian et al.
    2024). ``scale`` divides by the group's std (unbiased) + ``eps`` (GRPO; Dr. GRPO and RLOO do
    not). ``valid`` (N,) bool drops responses (non-finite rewards) from their group's statistics;
    their advantage is 0. A group without signal (:func:`no_signal_groups`) gets advantage 0 for
    every member, exactly.

    Returns:
        advantages (N,), and (N / G,) bool: the groups without signal.
    Naive equivalent: a Python loop over groups with ``statistics.mean/stdev`` (tests compare).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    valid = torch.isfinite(rewards) if valid is None else valid & torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size).double()
    m = valid.view(-1, group_size).double()
    n = m.sum(1, keepdim=True)
    total = (r * m).sum(1, keepdim=True)
    if baseline == "leave_one_out":
        base = (total - r) / (n - 1).clamp(min=1)
    elif baseline == "mean":
        base = total / n.clamp(min=1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; use mean or leave_one_out")
    mean = total / n.clamp(min=1)
    var = (((r - mean) ** 2) * m).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    adv = r - base
    if scale:
        adv = adv / (var.sqrt() + eps)
    no_signal = no_signal_groups(r, m.bool(), rewards.dtype)
    adv = torch.where(m.bool() & ~no_signal[:, None], adv, torch.zeros_like(adv))
    return adv.view(-1).to(rewards.dtype), no_signal


def no_signal_groups(r: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """(groups,) bool: fewer than 2 valid rewards, or valid rewards equal up to rounding.

    Decided from max − min of the valid rewards of ``r`` (groups, G), never from a variance: the
    mean of [0.7, 0.7, 0.7] in float64 carries rounding error, so their variance is not 0. "Equal
    up to rounding" (docs/algorithms.md §6): max − min ≤ 4 ε · max|r|, ε the machine epsilon of
    ``dtype`` (the rewards' own precision; 0 for integer rewards): 0.1 + 0.2 and 0.3 in float64
    differ by one unit of rounding and count as equal, 0.3 and 0.3 + 1e-9 do not.
    """
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    hi = torch.where(valid, r, -inf).amax(1)
    lo = torch.where(valid, r, inf).amin(1)
    size = torch.where(valid, r.abs(), torch.zeros_like(r)).amax(1)
    rtol = 4 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return (valid.sum(1) < 2) | (hi - lo <= rtol * size)
