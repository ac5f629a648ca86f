"""Log-probabilities of chosen tokens, and teacher-forced NLL (docs/algorithms.md §2 notation)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_rlhf.core.masked import masked_sum


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_size: int = 8) -> Tensor:
    """log softmax(logits)[labels] without materialising the full (B, T, V) log-softmax.

    Naive equivalent: ``logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0]``.
    Here: ``logit[label] - logsumexp(logits)``, computed ``chunk_size`` rows at a time in fp32,
    so the only vocabulary-sized temporary is one chunk's (the log-softmax copy of a 32k-vocab
    batch is what blows memory up first).

    Args:
        logits: (B, T, V) any float dtype.
        labels: (B, T) long token ids.
    Returns:
        (B, T) float32 log-probabilities.
    """
    out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        chunk = logits[rows].float()
        picked = chunk.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1)
        out[rows] = picked - torch.logsumexp(chunk, dim=-1)
    return out


def shifted_token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Teacher-forced log p(token_t | tokens_<t): logits at t-1 score the token at t.

    Args:
        logits: (B, T, V) from a causal LM over ``input_ids``.
        input_ids: (B, T).
    Returns:
        (B, T) with column 0 set to 0 (the first token has no prediction).
    """
    lp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 8) -> Tensor:
    """Entropy H(softmax(logits)) per position, in fp32, ``chunk_size`` rows at a time.

    H = logsumexp(z) − Σ softmax(z)·z. Naive equivalent: ``-(p * p.log()).sum(-1)`` with
    ``p = logits.softmax(-1)`` (which NaNs on p = 0).

    Args:
        logits: (B, T, V).
    Returns:
        (B, T) float32.
    """
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_size):
        z = logits[start : start + chunk_size].float()
        out[start : start + chunk_size] = torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1)
    return out


def sequence_logprobs(logits: Tensor, input_ids: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) log p(response | prompt) = Σ_t over response tokens of log p(token_t | tokens_<t).

    Args:
        logits: (B, T, V) from a causal LM over ``input_ids`` (B, T).
        response_mask: (B, T) 1 = response token (EOS included).
    Naive equivalent: per row, ``sum(log_softmax(logits[t - 1])[ids[t]] for t in response positions)``.
    """
    return masked_sum(shifted_token_logprobs(logits, input_ids), response_mask, dim=1)
