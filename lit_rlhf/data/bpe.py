"""A byte-level BPE tokenizer trained on a dataset's own text: causal models from scratch, offline.

With no pretrained causal LM on disk (the hub is unreachable in CI), a tiny Llama trained from
scratch on real dialogues (HH-RLHF) needs a tokenizer that covers their text. ``train_bpe`` learns
one from the training rows only (never the held-out ones), deterministically, in seconds; the
SFT export saves it next to the model (``save_pretrained``), so later stages load it from there.
"""

from __future__ import annotations

from typing import Any

from lit_rlhf.models.spec import BPETokenizerConfig


def corpus(config: BPETokenizerConfig) -> list[str]:
    """Every non-empty string field of the selected rows (HH: the chosen and rejected dialogues)."""
    from lit_rlhf.data.io import iter_rows, select_rows

    rows = select_rows(list(iter_rows(config.source)), config.rows)
    return [v for row in rows for v in row.data.values() if isinstance(v, str) and v.strip()]


def train_bpe(config: BPETokenizerConfig) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE; <pad>, <unk>, <bos> prepended, <eos>; the chat template
    and its special tokens when ``config.chat_template`` names one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from lit_rlhf.data.lexicon import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(config), trainer=trainer)
    bos = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=4096,
    )
    if config.chat_template is not None:
        from lit_rlhf.data.chat import add_chat_template

        add_chat_template(tokenizer, config.chat_template)
    return tokenizer
