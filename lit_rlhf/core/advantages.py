"""Generalized advantage estimation over response tokens (docs/algorithms.md §2.4; Schulman et al. 2016)."""

from __future__ import annotations

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
