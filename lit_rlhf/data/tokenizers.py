"""The tokenizer of a :class:`~lit_rlhf.models.spec.ModelSpec`: a hub or local tokenizer, an embedded
task's word-level one (``model.tokenizer=synthetic|reasoning|agent``), or a byte-level BPE learned from a
dataset (``model.train_tokenizer``), each prepared for the stages (pad token, left padding); and the
check that an embedded task's data meets a tokenizer that has its words."""

from __future__ import annotations

from typing import Any

from lit_rlhf.data.configs import EMBEDDED_SOURCES
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
    if source in EMBEDDED_TOKENIZERS:
        return prepare_tokenizer(embedded_tokenizer(source))
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


EMBEDDED_TOKENIZERS = ("synthetic", "reasoning", "agent")
"""``model.tokenizer`` values naming an embedded task's word-level tokenizer."""


def embedded_tokenizer(source: str) -> Any:
    """The word-level tokenizer of an embedded task (``synthetic``, ``reasoning``, or ``agent``: the
    multi-turn tasks' chat tokenizer), unprepared."""
    if source == "reasoning":
        from lit_rlhf.data.reasoning import build_tokenizer
    elif source == "agent":
        from lit_rlhf.data.agent_tasks import build_tokenizer
    else:
        from lit_rlhf.data.synthetic import build_tokenizer
    return build_tokenizer()


def check_embedded_vocabulary(tokenizer: Any, section: str, source: str) -> None:
    """Refuse an embedded task (``source``: one of :data:`EMBEDDED_SOURCES`, a made-up word-level language)
    paired with a model whose tokenizer does not have its words as tokens (a real model: Llama's
    tokenizer would chop the made-up words into pieces and train it off its own language).

    Raises:
        ConfigError: naming ``data``, with the data configs a real model takes instead.
    """
    from lit_rlhf.utils.config import ConfigError

    vocab = tokenizer.get_vocab()
    missing = [w for w in embedded_tokenizer(EMBEDDED_SOURCES[source]).get_vocab() if w not in vocab]
    if missing:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            "data",
            f"data.{section}.source={source} is an embedded toy task in its own word-level "
            f"language, for the tiny models (model=tiny_llama, tiny_reasoning, and models trained from "
            f"them), but the model's tokenizer ({name}) lacks its tokens ({', '.join(missing[:4])}, …). "
            "For a real model choose real data: data=hh_chat (HH-RLHF in the model's chat format), "
            "data=chat (your own conversations, preference pairs and prompts), data=qa_file",
        )
