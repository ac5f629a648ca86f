"""The forwards of the models an RL stage holds, over prompt + response rows: policy log-probs
and entropies (with grad in the update, without in the rollout) and critic values.

Every per-token quantity is read at the position BEFORE the token it scores: logits at t−1
predict token t, and V(s_t) is the value of the prefix that ends just before response token t.
So for a prompt of width P: ``full[:, P - 1 : -1]`` lines up with the response tokens.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.logprobs import entropy_from_logits, logprobs_from_logits
from lit_rlhf.core.masked import position_ids_from_mask


def _takes_logits_to_keep(model: Any) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def response_logits(
    model: Any, input_ids: Tensor, attention_mask: Tensor, prompt_width: int, padding_free: bool = False
) -> Tensor:
    """(B, R, V) logits that predict the R response tokens of ``input_ids`` (B, P + R).

    The LM head runs on those R positions only (``logits_to_keep``) where the model supports it:
    with long prompts and large vocabularies, prompt-position logits are most of the LM head's
    time and memory, and nothing reads them. With ``padding_free`` the forward runs on the packed
    real tokens (lit_rlhf/models/packed.py; the LM head only at real response tokens) and padded
    response positions get zero logits (every reader masks them).
    """
    if padding_free:
        packed = _packed_response_logits(model, input_ids, attention_mask, prompt_width)
        if packed is not None:
            return packed
    kwargs: dict[str, Any] = {}
    response_width = input_ids.shape[1] - prompt_width
    if _takes_logits_to_keep(model):
        kwargs["logits_to_keep"] = response_width + 1  # positions P-1 … T-1; the last predicts nothing
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        **kwargs,
    )
    return out.logits[:, -(response_width + 1) : -1]


def _packed_response_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor | None:
    """:func:`response_logits` through one packed forward, or None where the model fails its check."""
    from lit_rlhf.models.packed import packed_logits, packing_ok

    b, t = input_ids.shape
    r = t - prompt_width
    # response token j of row i is scored by the logits at column P - 1 + j, when both are real
    scored = attention_mask[:, prompt_width:].bool() & attention_mask[:, prompt_width - 1 : -1].bool()
    rows, cols = scored.nonzero(as_tuple=True)
    predicting = rows * t + prompt_width - 1 + cols
    if not packing_ok(model, input_ids, attention_mask, predicting):
        return None
    logits = packed_logits(model, input_ids, attention_mask, predicting)
    out = logits.new_zeros(b * r, logits.shape[-1]).index_copy(0, rows * r + cols, logits)
    return out.view(b, r, -1)


def response_logprobs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_width: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    padding_free: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(B, R) log π(y_t | x, y_<t) of the response tokens (and (B, R) entropies if asked).

    ``temperature`` divides the logits first (1.0 = the model's own distribution, the default
    in docs/algorithms.md §2; the sampling temperature is the alternative). ``padding_free``:
    see :func:`response_logits` (values at padded positions differ; real ones do not).
    """
    logits = response_logits(model, input_ids, attention_mask, prompt_width, padding_free)
    if temperature != 1.0:
        logits = logits / temperature
    labels = input_ids[:, prompt_width:]
    logprobs = logprobs_from_logits(logits, labels)
    if not with_entropy:
        return logprobs, None
    if entropy_grad:
        return logprobs, entropy_from_logits(logits)
    with torch.no_grad():
        return logprobs, entropy_from_logits(logits.detach())


def response_values(critic: Any, input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> Tensor:
    """(B, R) V(s_t) for the states before each response token."""
    return critic(input_ids, attention_mask)[:, prompt_width - 1 : -1]
