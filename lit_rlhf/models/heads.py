"""Pooling of per-token hidden states into one vector per sequence, and the scalar head.

The reward is read at the LAST non-pad token (docs/algorithms.md §1: an EOS is appended to every
response, so for a causal LM that token has attended to the whole prompt + response).
Index helpers work for left- and right-padded batches alike: they look at the mask, never at
the pad id.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lit_rlhf.core.masked import first_token_index, last_token_index

__all__ = ["Pooling", "ScalarHead", "first_token_index", "last_token_index", "pool"]

Pooling = Literal["last", "cls", "mean"]


def pool(hidden: Tensor, attention_mask: Tensor, mode: Pooling) -> Tensor:
    """(B, T, H) hidden states → (B, H): the last real token, the first (CLS), or the masked mean."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "last":
        return hidden[rows, last_token_index(attention_mask)]
    if mode == "cls":
        return hidden[rows, first_token_index(attention_mask)]
    if mode == "mean":
        m = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)
    raise ValueError(f"unknown pooling {mode!r}; use last, cls or mean")


class ScalarHead(nn.Module):
    """Linear (H → 1) on a pooled or per-token hidden state; computed in fp32 for stable scores."""

    def __init__(self, hidden_size: int, init_std: float | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        # 1/sqrt(H+1): scores start O(1) whatever the width (TRL's reward-head init)
        nn.init.normal_(self.proj.weight, std=init_std if init_std is not None else (hidden_size + 1) ** -0.5)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        """(..., H) → (...)"""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)
