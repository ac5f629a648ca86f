"""Non-finite values never reach the weights: counted skips, and a clean stop when they persist.

A reward that returns NaN or inf for some samples, a loss or a gradient that overflows: each is a
counted skip, never an update (docs/algorithms.md §2.9).

* samples whose score is not finite leave the update (``Rollout.valid_mask``), the running reward
  statistics and the group statistics: ``health/nonfinite_scores`` (not counting the rows a remote
  reward could not score, which are ``reward/<name>_errors`` and never make an iteration bad);
* an update whose loss (on any rank) or gradient is not finite is not applied — no optimizer or
  schedule step: ``health/skipped_updates``;
* ``algo.max_bad_iterations`` consecutive iterations with either stop the run with a
  :class:`NonFiniteTrainingError` naming the cause; the last checkpoint and export on disk are the
  last good ones (nothing is written on the way out);
* nothing is exported with non-finite weights (:func:`check_finite_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.utils.distributed import all_reduce_sum
from lit_rlhf.utils.errors import UserError


class NonFiniteTrainingError(UserError, RuntimeError):
    """Non-finite rewards, losses or gradients kept coming: the run stopped before they could do harm."""


def all_ranks_finite(x: Tensor) -> bool:
    """Whether ``x`` is finite on every rank (every rank must take the same branch after it)."""
    bad = torch.tensor([0.0 if bool(torch.isfinite(x).all()) else 1.0], device=x.device)
    return float(all_reduce_sum(bad)) == 0.0


def check_finite_state(state: Mapping[str, Tensor], what: str) -> None:
    """Refuse to write ``what`` when any floating tensor of ``state`` holds NaN or inf."""
    bad = [
        k
        for k, v in state.items()
        if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    if bad:
        raise NonFiniteTrainingError(f"refusing to write {what}: {len(bad)} tensors hold NaN/inf (e.g. {bad[:3]})")


class TrainingHealth:
    """Counts of one iteration, and the streak of bad iterations across them (checkpointed)."""

    def __init__(self, max_bad_iterations: int, reward_name: str) -> None:
        self.max_bad_iterations = max_bad_iterations
        self.reward_name = reward_name
        self.streak = 0
        self.nonfinite_scores = 0
        self.excused = 0
        self.samples = 0
        self.skipped_updates = 0
        self.updates = 0

    def count_scores(self, scores: Tensor) -> None:
        """Non-finite scores of this iteration's rollout, over all ranks."""
        counts = all_reduce_sum(
            torch.tensor([float((~torch.isfinite(scores)).sum()), float(scores.numel())], device=scores.device)
        )
        self.nonfinite_scores, self.samples = int(counts[0]), int(counts[1])

    def excuse(self, unscored: int, device: torch.device | str = "cpu") -> None:
        """Rows a remote reward could not score (its endpoint failed, lit_rlhf/rewards/http.py): left
        out of the update like any NaN score, counted in ``reward/<name>_errors``, and not held
        against the policy (they do not make the iteration bad). Summed over ranks."""
        counts = all_reduce_sum(torch.tensor([float(unscored)], device=device))
        self.excused = int(counts[0])

    def count_update(self, applied: bool) -> None:
        self.updates += 1
        self.skipped_updates += int(not applied)

    def end_iteration(self) -> dict[str, Tensor]:
        """The iteration's health statistics; raises once ``max_bad_iterations`` bad ones ran in a row."""
        self.nonfinite_scores = max(0, self.nonfinite_scores - self.excused)  # the policy's, not the server's
        stats = {
            "health/nonfinite_scores": torch.tensor(float(self.nonfinite_scores)),
            "health/skipped_updates": torch.tensor(float(self.skipped_updates)),
        }
        bad = self.nonfinite_scores > 0 or self.skipped_updates > 0
        self.streak = self.streak + 1 if bad else 0
        cause = self.cause()
        self.nonfinite_scores = self.excused = self.samples = self.skipped_updates = self.updates = 0
        if bad and self.streak >= self.max_bad_iterations:
            raise NonFiniteTrainingError(
                f"{cause} in {self.streak} consecutive iterations (algo.max_bad_iterations="
                f"{self.max_bad_iterations}); no update used them, and the last checkpoint "
                "and export on disk are from before"
            )
        return stats

    def cause(self) -> str:
        parts = []
        if self.nonfinite_scores:
            parts.append(
                f"{self.reward_name} returned NaN or inf for {self.nonfinite_scores} of {self.samples} samples"
            )
        if self.skipped_updates:
            parts.append(f"the loss or its gradient was not finite in {self.skipped_updates} of {self.updates} updates")
        return "; ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
