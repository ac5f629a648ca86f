"""Advantages: GAE over response tokens for PPO (docs/algorithms.md §2.4; Schulman et al. 2016) and
group-relative advantages for the critic-free methods (§6)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


def gae(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages and returns of each response token; V and A are 0 after the last token.

    δ_t = R_t + γ V_{t+1} − V_t;   A_t = δ_t + γλ A_{t+1};   G_t = A_t + V_t (critic target).

    Args:
        rewards: (B, T) per-token rewards (shaped), 0 outside the response.
        values: (B, T) V(s_t) of the critic at rollout time.
        response_mask: (B, T) 1 = response token; each row's ones are contiguous from column 0
            (responses are right-padded after their EOS).
    Returns:
        advantages (B, T), returns (B, T); both 0 where the mask is 0.

    Naive equivalent: a Python loop per row over its L tokens with V_{L} := 0 (tests compare).
    """
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # `where`, not `* mask`: an inf/NaN at a padded position would turn into NaN (inf·0) and
    # flow backwards through the recursion into every real token of the row
    values = torch.where(keep, values, zero)
    rewards = torch.where(keep, rewards.to(values.dtype), zero)
    mask = keep.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]
    return advantages, (advantages + values) * mask


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
    their advantage is 0.

    Returns:
        advantages (N,), and (N / G,) bool: the groups whose valid rewards are all equal (no signal).
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
    no_signal = (var.squeeze(1) == 0) | (n.squeeze(1) < 2)
    adv = torch.where(m.bool(), adv, torch.zeros_like(adv))
    return adv.view(-1).to(rewards.dtype), no_signal
