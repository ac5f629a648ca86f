"""KL estimators and KL-coefficient controllers (docs/algorithms.md §2.3).

With d_t = log π(y_t|·) − log π_ref(y_t|·) on sampled tokens (http://joschu.net/blog/kl-approx.html):
k1 = d (unbiased, can be negative), k2 = ½d² (low variance, biased), k3 = e^{−d} + d − 1 (unbiased
for KL(π‖π_ref), always ≥ 0). d is clamped to ±``clamp`` and k3 to ≤ ``k3_max`` so one wild
token cannot blow up a batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lit_rlhf.core.masked import masked_sum, zero_outside

Estimator = Literal["k1", "k2", "k3"]


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: Estimator = "k1",
    clamp: float | None = 20.0,
    k3_max: float | None = 10.0,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate (B, T) from (B, T) log-probs of the sampled tokens.

    ``clamp``/``k3_max`` None = no clamp (k3 still cannot overflow: d is then clamped to ±80,
    where e^80 is finite in float32). With ``mask`` (B, T), d is 0 outside it BEFORE e^{−d}:
    the estimate and its gradient are exactly 0 at padded positions whatever the log-probs hold
    there (a loss must pass it: masking afterwards leaves 0·NaN = NaN in ``.grad``).
    """
    d = logprobs - ref_logprobs
    d = zero_outside(d, mask) if mask is not None else d
    d = d.clamp(-clamp, clamp) if clamp is not None else d
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        k3 = torch.exp(-d.clamp(min=-80.0)) + d - 1.0
        return k3.clamp(max=k3_max) if k3_max is not None else k3
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def sequence_kl(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    estimator: Estimator = "k1",
    clamp: float | None = 20.0,
    k3_max: float | None = 10.0,
) -> Tensor:
    """(B,) KL estimate of each response: Σ_t over its tokens of :func:`kl_penalty`.

    The one definition of a response's KL, used by the KL controller (clamped, as the penalty),
    and by the monitors, validation and the demo table (``clamp=None`` for k1: the exact sum of
    log-ratios of the sampled tokens, docs/algorithms.md §4). Padded positions never enter the
    sum, whatever they hold.
    """
    return masked_sum(kl_penalty(logprobs, ref_logprobs, estimator, clamp, k3_max, response_mask), response_mask, dim=1)


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
