"""Sampler–trainer mismatch: how far the log-probs a rollout engine sampled with are from the
trainer's recomputation, and the corrections for it (docs/algorithms.md §2.10): truncated or masked
importance weights per token or per response, IcePop's band mask, the geometric-mean mask.

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
    return correction_weights(trainer_logprobs, sampler_logprobs, mask, "token_truncate", cap)[0]


def sampler_mismatch(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-token statistics of the gap, over the response tokens:

    * ``sampler_kl`` — the k3 estimate of KL(π_sampler ‖ π_trainer) on the sampled tokens,
      mean of e^{−d} + d − 1 with d = logp_sampler − logp_trainer (≥ 0, 0 iff they agree);
    * ``sampler_logprob_diff_max`` — max |logp_sampler − logp_trainer|.
    """
    # float64: with gaps of 1e-6 the k3 terms are 1e-12, below float32's rounding of e^{-d} + d − 1
    d = zero_outside(sampler_logprobs.detach().double() - trainer_logprobs.detach().double(), mask)
    m = mask.bool()
    return {
        "sampler_kl": masked_mean(torch.exp(-d) + d - 1.0, mask).float(),
        "sampler_logprob_diff_max": (d.abs()[m].max() if m.any() else d.new_zeros(())).float(),
    }


def _quantiles(weights: Tensor, mask: Tensor) -> dict[str, Tensor]:
    kept = weights[mask.bool()].float()
    if kept.numel() == 0:
        kept = weights.new_ones(1).float()
    q = torch.quantile(kept, kept.new_tensor([0.05, 0.5, 0.95]))
    return {"correction_weight_p05": q[0], "correction_weight_p50": q[1], "correction_weight_p95": q[2]}


def correction_weights(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> tuple[Tensor, dict[str, Tensor]]:
    """(B, T) detached weights of each token's policy-gradient term for a sampler that is not the
    trainer, and their statistics (docs/algorithms.md §2.10). With d_t = logp_trainer − logp_sampler,
    r_t = e^{d_t} per token and R_i = e^{Σ_t d_t} per response:

    * ``tis`` / ``token_truncate``: min(r_t, C); ``token_mask``: r_t, or 0 where r_t > C;
    * ``decoupled``: r_t uncapped, decoupled PPO's behaviour weight π_prox/μ (Hilton et al. 2022; the
      trainer's recomputation is the proximal policy, the sampler the behaviour policy); d_t is held
      below 80 so that the weight stays finite;
    * ``sequence_truncate``: min(R_i, C) on every token of response i; ``sequence_mask``: R_i, or 0
      where R_i > C;
    * ``icepop``: r_t inside ``band`` = [α, β], 0 outside (IcePop);
    * ``geo_mask``: 1 where the response's geometric-mean ratio e^{mean_t d_t} is inside ``band``,
      0 for the whole response otherwise.

    Statistics: ``correction_masked_frac`` (the share of response tokens whose weight is 0 by the
    correction) and the 5/50/95% quantiles of the weights over the response tokens.
    """
    if cap <= 0:
        raise ValueError(f"the correction's cap must be > 0, got {cap}")
    low, high = band
    if not 0 <= low < high:
        raise ValueError(f"the correction band must satisfy 0 <= low < high, got {band}")
    keep = mask.bool()
    d = zero_outside(trainer_logprobs.detach().float() - sampler_logprobs.detach().float(), keep)
    token = torch.exp(d)
    masked = torch.zeros_like(keep)
    if mode in ("tis", "token_truncate"):
        w = token.clamp(max=cap)
    elif mode == "decoupled":
        w = torch.exp(d.clamp(max=80.0))
    elif mode == "token_mask":
        masked = token > cap
        w = torch.where(masked, torch.zeros_like(token), token)
    elif mode in ("sequence_truncate", "sequence_mask"):
        seq = torch.exp(d.sum(1, keepdim=True).clamp(max=80.0)).expand_as(d)  # e^80: past any cap, finite
        if mode == "sequence_truncate":
            w = seq.clamp(max=cap)
        else:
            masked = seq > cap
            w = torch.where(masked, torch.zeros_like(seq), seq)
    elif mode == "icepop":
        masked = (token < low) | (token > high)
        w = torch.where(masked, torch.zeros_like(token), token)
    elif mode == "geo_mask":
        geo = torch.exp(masked_mean(d, keep, dim=1)).unsqueeze(1).expand_as(d)
        masked = (geo < low) | (geo > high)
        w = (~masked).float()
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    w = zero_outside(w, keep)
    stats = {"correction_masked_frac": masked_mean((masked & keep).float(), keep), **_quantiles(w, keep)}
    return w, stats
