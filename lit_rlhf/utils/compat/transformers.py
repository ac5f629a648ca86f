"""transformers internals (pinned transformers==5.24.0; lit_rlhf/utils/compat/__init__.py): the
attention implementation a model's config selected, as the inlined decoding layers call it."""

from __future__ import annotations

from typing import Any, Callable

from lit_rlhf.utils.compat import private_attr


def attention_interface(config: Any, eager: Callable[..., Any] | None) -> Callable[..., Any]:
    """The attention function a model with ``config`` runs (``config._attn_implementation`` looked
    up in transformers' registry), with ``eager`` as the fallback for "eager"."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = private_attr(config, "_attn_implementation", "transformers", "PretrainedConfig._attn_implementation")
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
