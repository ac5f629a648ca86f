"""KL estimators and KL-coefficient controllers (ALGORITHMS §2).

With d_t = log π(y_t|·) − log π_ref(y_t|·) on sampled tokens (http://joschu.net/blog/kl-approx.html):
k1 = d (unbiased, can be negative), k2 = ½d² (low variance, biased), k3 = e^{−d} + d − 1 (unbiased
for KL(π‖π_ref), always ≥ 0). d is clamped to ±``clamp`` and k3 to ≤ ``k3_max`` so one wild
token cannot blow up a batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["k1", "k2", "k3"]


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: Estimator = "k1", clamp: float = 20.0, k3_max: float = 10.0
) -> Tensor:
    """Per-token KL estimate (B, T) from (B, T) log-probs of the sampled tokens."""
    d = (logprobs - ref_logprobs).clamp(-clamp, clamp)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return (torch.exp(-d) + d - 1.0).clamp(max=k3_max)
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019 (arXiv 1909.08593, §2.2): β follows a target sequence KL.

    e = clip(KL/target − 1, −0.2, 0.2);  β ← β · (1 + e · n / horizon), n = samples in the batch.
    """

    def __init__(self, value: float, target: float, horizon: int) -> None:
        super().__init__(value)
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target > 0 and horizon > 0")
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
