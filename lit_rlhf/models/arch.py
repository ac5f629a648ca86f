"""Architecture numbers of a model without building it (for the memory plan, lit_rlhf/launch/memory_plan.py):
from ``model.tiny``, a local ``config.json`` (or a LoRA export's base), or the presets' hub models."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arch:
    """The shape numbers a plan needs (a Llama-style or GPT-NeoX decoder)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    family: str = "llama"  # llama (gated MLP, no biases) | gpt_neox (4h MLP, biases, untied output)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        if self.family == "gpt_neox":
            return (h * 3 * h + 3 * h) + (h * h + h) + (2 * h * self.intermediate + self.intermediate + h) + 4 * h
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h

    def params(self) -> int:
        embed = self.vocab * self.hidden
        final_norm = self.hidden * (2 if self.family == "gpt_neox" else 1)
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + final_norm

    def largest_layer_params(self) -> int:
        """The largest module DeepSpeed ZeRO-3 gathers at once (the embedding, for LMs)."""
        return max(self.vocab * self.hidden, self.layer_params())

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Adapter parameters ``r·(in + out)`` per adapted linear layer."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        if self.family == "gpt_neox":
            shapes = {"query_key_value": (h, 3 * h), "dense": (h, h), "dense_h_to_4h": (h, i), "dense_4h_to_h": (i, h)}
        else:
            shapes = {
                "q_proj": (h, h),
                "k_proj": (h, kv),
                "v_proj": (h, kv),
                "o_proj": (h, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            }
        chosen = shapes if list(targets) == ["all-linear"] else {k: v for k, v in shapes.items() if k in targets}
        return self.layers * sum(r * (a + b) for a, b in chosen.values())


# architectures of the presets' hub models, so that --plan works offline (config.json otherwise)
KNOWN: dict[str, Arch] = {
    "llama-2-7b": Arch(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, tied=False),
    "llama-2-13b": Arch(vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824, tied=False),
    "pythia-410m": Arch(
        vocab=50304, hidden=1024, layers=24, heads=16, kv_heads=16, intermediate=4096, tied=False, family="gpt_neox"
    ),
}


def arch_from_hf_config(config: dict[str, Any]) -> Arch:
    family = "gpt_neox" if config.get("model_type") == "gpt_neox" else "llama"
    heads = config["num_attention_heads"]
    return Arch(
        vocab=config["vocab_size"],
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        tied=bool(config.get("tie_word_embeddings", family == "llama")),
        family=family,
    )


def arch_of(spec: Any, path: str | None = None, tiny_vocab: int | None = None) -> tuple[Arch | None, str]:
    """(architecture, where it came from) of a model spec or a saved model folder; None if unknown
    offline. A tiny model's vocabulary is its tokenizer's size, ``tiny_vocab`` (the caller builds
    the tokenizer: lit_rlhf/data/tokenizers.py)."""
    from lit_rlhf.models.builders import resolve_path

    if path is None and spec.tiny is not None:
        if tiny_vocab is None:
            raise ValueError("a tiny model's architecture needs its vocabulary size (tiny_vocab)")
        t = spec.tiny
        vocab = tiny_vocab
        return Arch(
            vocab=vocab,
            hidden=t.hidden_size,
            layers=t.num_hidden_layers,
            heads=t.num_attention_heads,
            kv_heads=t.num_key_value_heads or t.num_attention_heads,
            intermediate=t.intermediate_size,
            tied=t.tie_word_embeddings,
        ), "model.tiny"
    name = path or spec.name_or_path
    try:
        local = resolve_path(name)
    except Exception:  # pkg:// of a missing package: unknown here
        local = name
    for candidate in (os.path.join(local, "config.json"), os.path.join(local, "adapter_config.json")):
        if os.path.isfile(candidate):
            with open(candidate) as fh:
                config = json.load(fh)
            if "base_model_name_or_path" in config:  # a LoRA export: its base's shape
                return arch_of(spec, config["base_model_name_or_path"], tiny_vocab)
            return arch_from_hf_config(config), candidate
    key = name.rsplit("/", 1)[-1].lower().removesuffix("-hf")
    if key in KNOWN:
        return KNOWN[key], f"known architecture of {name}"
    return None, f"{name}: no config.json here and not a known architecture"
