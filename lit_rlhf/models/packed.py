"""Padding-free forwards of a causal LM (docs/architecture.md, "Padding-free forwards").

:func:`packed_logits` runs a padded batch through the packed layout of
:mod:`lit_rlhf.core.packing`: the decoder sees only real tokens, and the LM head runs only at
the positions asked for (response tokens; prompt positions are most of a long-prompt batch's
LM-head cost and nothing reads them). Packed sequences are kept apart by position ids that
restart at 0 with no 2-D attention mask, which transformers' attention implementations (eager,
sdpa, flex: a block-diagonal mask; flash-attention: varlen from the positions, one row) turn
into per-sequence attention.

A model whose attention ignored the restarting positions, or whose logits are more than
``lm_head(decoder(x))`` (soft-capping, scaling), would score wrongly and silently. So
:func:`packing_ok` checks each model on the first batch it scores: packed and padded
log-softmaxes must agree (|Δ| ≤ 1e-3 in fp32, 5e-2 in half precision); a model that fails, or
has no ``get_decoder``/``get_output_embeddings``, keeps the padded forward for the run, with a
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.logprobs import logprobs_from_logits
from lit_rlhf.core.logprobs import sequence_logprobs as padded_sequence_logprobs
from lit_rlhf.core.masked import position_ids_from_mask
from lit_rlhf.core.packing import pack, unpack
from lit_rlhf.utils.facts import known, recall

log = logging.getLogger(__name__)
# attention implementations that read packed sequences from one row's restarting positions
ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3")


def _attn_implementation(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def _parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, LM head) of a transformers causal LM, or None; None for an FSDP unit too, whose
    weights only its own forward gathers (calling decoder and head separately would bypass it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return (decoder, head) if decoder is not None and head is not None and decoder is not model else None


def packed_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
    """(N, V) logits at flat (B·T) indices ``positions`` (real tokens) of ``input_ids`` (B, T),
    from ONE decoder forward over the packed rows and the LM head at those N positions only.

    Naive equivalent: ``model(input_ids, attention_mask, position_ids=…).logits.flatten(0, 1)[positions]``.
    """
    decoder, head = _parts(model)
    packed = pack(input_ids, attention_mask, one_row=_attn_implementation(model) in ONE_ROW_ATTENTION)
    out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return head(hidden.reshape(-1, hidden.shape[-1])[packed.packed_index(positions)])


def _padded(module: Any, input_ids: Tensor, attention_mask: Tensor) -> Any:
    """The usual padded forward (positions count real tokens) of a causal LM or its trunk."""
    return module(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )


def padded_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
    """The same (N, V) logits from the usual padded forward."""
    logits = _padded(model, input_ids, attention_mask).logits
    return logits.reshape(-1, logits.shape[-1])[positions]


def packing_ok(model: Any, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> bool:
    """Whether ``model`` scores packed batches as it scores padded ones: decided on the first
    batch it sees (no grad, eval mode: no dropout, nothing drawn from the RNG), then remembered."""
    if _parts(model) is None:
        return _verdict(model, lambda: None)
    return _verdict(
        model,
        lambda: (
            packed_logits(model, input_ids, attention_mask, positions).float().log_softmax(-1),
            padded_logits(model, input_ids, attention_mask, positions).float().log_softmax(-1),
        ),
    )


def packed_hidden_states(trunk: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, T, H) last hidden states of a causal transformer without LM head (``LlamaModel``), from
    ONE forward over the packed real tokens, laid back out as the padded batch (zeros at padding).

    Naive equivalent: ``trunk(input_ids, attention_mask, position_ids=…).last_hidden_state``.
    """
    packed = pack(input_ids, attention_mask, one_row=_attn_implementation(trunk) in ONE_ROW_ATTENTION)
    out = trunk(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    return unpack(out.last_hidden_state, packed)


def hidden_packing_ok(trunk: Any, input_ids: Tensor, attention_mask: Tensor) -> bool:
    """:func:`packing_ok` for a trunk's hidden states (compared at the real tokens)."""

    def both() -> tuple[Tensor, Tensor]:
        real = attention_mask.bool()
        padded = _padded(trunk, input_ids, attention_mask).last_hidden_state
        return packed_hidden_states(trunk, input_ids, attention_mask)[real].float(), padded[real].float()

    return _verdict(trunk, both)


def trunk_hidden_states(trunk: Any, input_ids: Tensor, attention_mask: Tensor, padding_free: bool) -> Tensor:
    """(B, T, H) last hidden states of a causal trunk: packed (``padding_free`` and
    :func:`hidden_packing_ok`; zeros at padding) or padded (positions count real tokens)."""
    if padding_free and hidden_packing_ok(trunk, input_ids, attention_mask):
        return packed_hidden_states(trunk, input_ids, attention_mask)
    return _padded(trunk, input_ids, attention_mask).last_hidden_state


def packing_verdict(model: Any) -> bool | None:
    """What :func:`packing_ok` decided for ``model`` (None: not checked yet)."""
    return known(model, "packing_verdict")


def _verdict(model: Any, both: Callable[[], tuple[Tensor, Tensor] | None]) -> bool:
    return recall(model, "packing_verdict", lambda: _check(model, both))


@torch.no_grad()
def _check(model: Any, both: Callable[[], tuple[Tensor, Tensor] | None]) -> bool:
    """Run ``both()`` → (packed, padded) values in eval mode and compare them."""
    name = f"{type(model).__name__} (attention {_attn_implementation(model) or '?'})"
    training = model.training
    model.eval()
    try:
        values = both()
    finally:
        model.train(training)
    if values is None:
        log.info(
            "padding-free forward: %s has no separate decoder and LM head to call (or is an FSDP unit); "
            "using padded forwards",
            name,
        )
        return False
    packed, padded = values
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    gap = float((packed - padded).abs().max()) if packed.numel() else 0.0
    if gap <= tol:
        log.info("padding-free forward of %s matches the padded forward (max |Δ| %.1e)", name, gap)
        return True
    log.warning(
        "padding-free forward of %s differs from the padded one by %.3g (its attention does not keep packed "
        "sequences apart, or its logits are more than lm_head(decoder(x))); using padded forwards",
        name,
        gap,
    )
    return False


def scored_positions(attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """Flat (B·T) indices of the tokens a sequence log-prob sums: response tokens that have a
    real token before them in their row (the logits there score them)."""
    keep = response_mask.bool() & attention_mask.bool()
    keep[:, 0] = False
    keep[:, 1:] &= attention_mask[:, :-1].bool()
    return keep.reshape(-1).nonzero().squeeze(1)


def sequence_logprobs(
    model: Any, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, padding_free: bool = True
) -> Tensor:
    """(B,) log p(response | prompt) = Σ over response tokens of log p(token | its prefix), from
    one packed forward (``padding_free`` and :func:`packing_ok`) or one padded forward."""
    flat = scored_positions(attention_mask, response_mask)
    if not (padding_free and packing_ok(model, input_ids, attention_mask, flat - 1)):
        return padded_sequence_logprobs(_padded(model, input_ids, attention_mask).logits, input_ids, response_mask)
    logits = packed_logits(model, input_ids, attention_mask, flat - 1)
    token_lp = logprobs_from_logits(logits[None], input_ids.reshape(-1)[flat][None])[0]
    rows = flat // input_ids.shape[1]
    return torch.zeros(input_ids.shape[0], dtype=token_lp.dtype, device=token_lp.device).index_add(0, rows, token_lp)
