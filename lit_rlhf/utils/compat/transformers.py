"""transformers internals (pinned transformers==5.19.0; lit_rlhf/utils/compat/__init__.py): the
attention implementation a model's config selected, as the inlined decoding layers call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lit_rlhf.utils.compat import private_attr


def attention_interface(config: Any, eager: Callable[..., Any] | None) -> Callable[..., Any]:
    """The attention function a model with ``config`` runs (``config._attn_implementation`` looked
    up in transformers' registry), with ``eager`` as the fallback for "eager"."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = private_attr(config, "_attn_implementation", "transformers", "PretrainedConfig._attn_implementation")
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def cache_keyword() -> str:
    """The keyword a causal LM's forward and its decoder layers take the KV cache by: ``cache``
    in transformers 5.20 and later, ``past_key_values`` before (the pinned 5.19: vLLM's CPU build
    requires < 5.20); tests/utils/test_compat.py checks it against the installed transformers. Read
    from the signature at each call (~20 µs): a decoding loop asks once."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache a forward returned (``out.cache``; ``out.past_key_values`` before 5.20)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values
