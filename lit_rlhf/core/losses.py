"""Losses; each returns ``(loss, stats)`` with stats detached (STYLE rule 9).

Implemented so far: the pairwise reward-model loss (ALGORITHMS §1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def pairwise_rm_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss of a reward model on preference pairs (ALGORITHMS §1).

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
