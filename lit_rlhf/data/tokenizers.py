"""The tokenizer of a :class:`~lit_rlhf.models.spec.ModelSpec`: a hub or local tokenizer, an embedded
task's word-level one (``model.tokenizer=synthetic|reasoning``), or a byte-level BPE learned from a
dataset (``model.train_tokenizer``), each prepared for the stages (pad token, left padding)."""

from __future__ import annotations

from typing import Any

from lit_rlhf.models.builders import from_pretrained, resolve_path
from lit_rlhf.models.spec import ModelSpec


def prepare_tokenizer(tokenizer: Any, kind: str = "causal_lm") -> Any:
    """Give a tokenizer a pad token and left padding (for generation).

    Without a pad token we reuse ``unk`` (or ``eos``): lit_rlhf builds every mask from sequence
    lengths in ``data/collate.py``, never from ``ids != pad_token_id``, so sharing an id with
    EOS cannot hide real EOS tokens from the loss. Adding a new token would need a resized
    embedding matrix and diverge from the saved model.
    """
    if tokenizer.pad_token is None:
        fallback = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
        if fallback is None:
            raise ValueError("the tokenizer has no pad, unk or eos token; set one before training")
        tokenizer.pad_token = fallback
    if kind == "causal_lm" and tokenizer.eos_token is None:
        raise ValueError("the tokenizer has no eos_token: every causal-LM stage needs one to end responses")
    tokenizer.padding_side = "left"
    return tokenizer


def build_tokenizer(spec: ModelSpec) -> Any:
    """The spec's tokenizer, prepared (pad token, left padding)."""
    if spec.train_tokenizer is not None:
        from lit_rlhf.data.bpe import train_bpe

        return prepare_tokenizer(train_bpe(spec.train_tokenizer))
    source = spec.tokenizer_source
    if source == "synthetic":
        from lit_rlhf.data.synthetic import build_tokenizer as synthetic_tokenizer

        return prepare_tokenizer(synthetic_tokenizer())
    if source == "reasoning":
        from lit_rlhf.data.reasoning import build_tokenizer as reasoning_tokenizer

        return prepare_tokenizer(reasoning_tokenizer())
    from transformers import AutoTokenizer

    key = "model.tokenizer" if spec.tokenizer else "model.name_or_path"
    tok = from_pretrained(
        AutoTokenizer.from_pretrained,
        resolve_path(source),
        "tokenizer",
        key,
        trust_remote_code=spec.trust_remote_code,
        revision=spec.revision,
    )
    return prepare_tokenizer(tok, spec.kind)
