"""Turning reward-model scores into per-token rewards (docs/algorithms.md §2 "Reward shaping")."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lit_rlhf.core.masked import last_token_index
from lit_rlhf.core.running_stats import RunningMoments


def penalize_missing_eos(scores: Tensor, ended: Tensor, penalty: float) -> Tensor:
    """score − penalty for responses truncated without an EOS (``ended`` (B,) bool)."""
    return scores - penalty * (~ended.bool()).to(scores.dtype)


def reparameterize_scores(
    scores: Tensor,
    moments: RunningMoments,
    mode: Literal["none", "scale", "normalize"],
    clip: float | None,
    all_reduce=None,
    valid: Tensor | None = None,
) -> Tensor:
    """Score scaling r/σ_run or normalization (r − μ_run)/σ_run, then clipping to ±clip.

    The running moments are updated with this batch BEFORE it is transformed (docs/algorithms.md §2),
    with its ``valid`` (B,) scores only (a NaN would poison the moments for the rest of the run).
    """
    moments.update(scores if valid is None else scores[valid], all_reduce)
    if mode == "scale":
        scores = scores / (moments.std + 1e-8)
    elif mode == "normalize":
        scores = (scores - moments.mean) / (moments.std + 1e-8)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


def shape_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, beta: float) -> Tensor:
    """R_t = −β·kl_t on every response token; the score is added ON the last response token.

    The last token is the EOS (or the final token of a truncated response): inside the loss
    mask, not one past it (DeepSpeed-Chat's off-by-one, docs/algorithms.md §2).

    Args:
        scores: (B,) sequence scores.
        kl: (B, T) per-token KL estimates.
        response_mask: (B, T) 1 = response token.
    Returns:
        (B, T) rewards, 0 outside the mask.
    """
    mask = response_mask.to(kl.dtype)
    rewards = -beta * kl * mask
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(response_mask)] += scores.to(rewards.dtype)
    return rewards


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to the reward; (B,) from (B,) lengths.

    0 if |y| ≤ L_max − L_c;  (L_max − L_c − |y|) / L_c inside the last L_c tokens;  −1 beyond L_max.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    start = max_length - buffer
    inside = (start - lengths.to(torch.float32)) / buffer
    return torch.where(
        lengths <= start, torch.zeros_like(inside), torch.where(lengths <= max_length, inside, -torch.ones_like(inside))
    )
