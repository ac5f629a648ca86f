"""Padding-free sequence log-probs of a causal LM (docs/architecture.md, "Padding-free forwards").

:class:`PaddingFree` scores a right- or left-padded batch through the packed layout of
:mod:`lit_rlhf.core.packing`: the linear layers see only real tokens, which is most of a
preference batch's cost saved when its lengths differ. Packed sequences are kept apart by
position ids that restart at 0 with no 2-D attention mask, which transformers' attention
implementations (eager, sdpa, flex: a block-diagonal mask; flash-attention: varlen from the
positions, one row) turn into per-sequence attention.

A model whose attention does not do that would let packed sequences see each other, silently.
So the first batch each model scores is checked: packed and padded per-token log-probs must
agree (|Δ| ≤ 1e-3 in fp32, 5e-2 in half precision); a model that fails keeps the padded forward
for the run, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.logprobs import logprobs_from_logits, sequence_logprobs
from lit_rlhf.core.packing import pack

log = logging.getLogger(__name__)
# attention implementations that read packed sequences from one row's restarting positions
ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3")


def _attn_implementation(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def scored_positions(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """Flat (B·T) indices of the tokens a sequence log-prob sums: response tokens that have a
    real token before them in their row."""
    keep = response_mask.bool() & attention_mask.bool()
    keep[:, 0] = False
    keep[:, 1:] &= attention_mask[:, :-1].bool()
    return keep.reshape(-1).nonzero().squeeze(1)


def packed_token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, flat: Tensor, pad_id: int) -> Tensor:
    """(N,) log p(token | its prefix) of the tokens at flat padded indices ``flat``, from ONE
    forward over the packed rows."""
    packed = pack(input_ids, attention_mask, pad_id, one_row=_attn_implementation(model) in ONE_ROW_ATTENTION)
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
    predicting = packed.packed_index(flat - 1)  # the logits at the previous position score the token
    picked = logits.reshape(-1, logits.shape[-1])[predicting]
    return logprobs_from_logits(picked[None], input_ids.reshape(-1)[flat][None])[0]


def padded_token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, flat: Tensor) -> Tensor:
    """The same (N,) values from the usual padded forward."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    predicting = flat - 1
    picked = logits.reshape(-1, logits.shape[-1])[predicting]
    return logprobs_from_logits(picked[None], input_ids.reshape(-1)[flat][None])[0]


class PaddingFree:
    """Sequence log-probs Σ_{t ∈ response} log π(y_t | y_<t), packed when ``enabled`` and the
    model passed its check, else padded (:func:`~lit_rlhf.core.logprobs.sequence_logprobs`)."""

    def __init__(self, enabled: bool = True, pad_id: int = 0):
        self.enabled = enabled
        self.pad_id = pad_id
        self.verdicts: dict[int, bool] = {}  # id(model) -> packed forward agrees with padded

    def uses_packing(self, model: Any) -> bool | None:
        """True/False once ``model`` was checked; None before (or when packing is off: False)."""
        return self.verdicts.get(id(model)) if self.enabled else False

    def sequence_logprobs(self, model: Any, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
        """(B,) log p(response | prompt) of each row."""
        if not self.enabled or self.verdicts.get(id(model)) is False:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            return sequence_logprobs(logits, input_ids, response_mask)
        flat = scored_positions(input_ids, attention_mask, response_mask)
        if id(model) not in self.verdicts:
            self.verdicts[id(model)] = self._check(model, input_ids, attention_mask, flat)
            if not self.verdicts[id(model)]:
                return self.sequence_logprobs(model, input_ids, attention_mask, response_mask)
        token_lp = packed_token_logprobs(model, input_ids, attention_mask, flat, self.pad_id)
        rows = flat // input_ids.shape[1]
        return torch.zeros(input_ids.shape[0], dtype=token_lp.dtype, device=token_lp.device).index_add(0, rows, token_lp)

    @torch.no_grad()
    def _check(self, model: Any, input_ids: Tensor, attention_mask: Tensor, flat: Tensor) -> bool:
        training = model.training
        model.eval()  # no dropout: the two forwards must be comparable, and draw nothing from the RNG
        try:
            packed = packed_token_logprobs(model, input_ids, attention_mask, flat, self.pad_id)
            padded = padded_token_logprobs(model, input_ids, attention_mask, flat)
        finally:
            model.train(training)
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        gap = float((packed - padded).abs().max()) if flat.numel() else 0.0
        ok = gap <= tol
        if ok:
            log.info("padding-free forward of %s (attention %s): matches the padded forward (max |Δ log p| %.1e)",
                     type(model).__name__, _attn_implementation(model) or "?", gap)  # fmt: skip
        else:
            log.warning("padding-free forward of %s (attention %s) differs from the padded one by %.3g in a token "
                        "log-prob (its attention does not keep packed sequences apart); using padded forwards",
                        type(model).__name__, _attn_implementation(model) or "?", gap)  # fmt: skip
        return ok
