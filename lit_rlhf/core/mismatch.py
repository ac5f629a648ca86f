"""Sampler–trainer mismatch: how far the log-probs a rollout engine sampled with are from the
trainer's recomputation, and truncated importance sampling (TIS) to correct for it
(docs/algorithms.md §2.10).

The engine that samples (an inlined KV-cache loop, vLLM) and the trainer's forward compute
log π(y_t|·) with different kernels, precisions and batch shapes, so π_sampler ≠ π_trainer even at
the same weights: the rollout is slightly off-policy. Yao et al. 2025 ("Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training") weight the policy-gradient term of each token by
w_t = min(π_trainer(y_t) / π_sampler(y_t), C), a truncated importance ratio (no gradient through w).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_rlhf.core.masked import masked_mean, zero_outside


def truncated_is_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """(B, T) w_t = min(exp(logp_trainer − logp_sampler), cap), detached; 0 outside ``mask``.

    Args:
        trainer_logprobs: the trainer's recomputed log-probs of the sampled tokens (the old
            log-probs of the ratio's denominator).
        sampler_logprobs: the engine's log-probs of the same tokens, returned with them.
        mask: (B, T) 1 = response token.
        cap: C > 0, the truncation (Yao et al. use 2).
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    diff = zero_outside(trainer_logprobs.detach().float() - sampler_logprobs.detach().float(), mask)
    return zero_outside(torch.exp(diff).clamp(max=cap), mask)


def sampler_mismatch(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-token statistics of the gap, over the response tokens:

    * ``sampler_kl`` — the k3 estimate of KL(π_sampler ‖ π_trainer) on the sampled tokens,
      mean of e^{−d} + d − 1 with d = logp_sampler − logp_trainer (≥ 0, 0 iff they agree);
    * ``sampler_logprob_diff_max`` — max |logp_sampler − logp_trainer|.
    """
    d = zero_outside(sampler_logprobs.detach().float() - trainer_logprobs.detach().float(), mask)
    m = mask.bool()
    return {
        "sampler_kl": masked_mean(torch.exp(-d) + d - 1.0, mask),
        "sampler_logprob_diff_max": d.abs()[m].max() if m.any() else d.new_zeros(()),
    }
