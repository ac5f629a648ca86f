"""Strategy factories for what YAML cannot spell directly (sets of layer classes for FSDP)."""

from __future__ import annotations

from typing import Any, Sequence


def fsdp_strategy(wrap_layers: Sequence[str], activation_checkpointing: bool = False, **kwargs: Any) -> Any:
    """``FSDPStrategy`` wrapping every instance of the named transformer-block classes.

    Args:
        wrap_layers: import paths, e.g. ``transformers.models.llama.modeling_llama.LlamaDecoderLayer``.
        activation_checkpointing: also checkpoint those blocks' activations.
        **kwargs: passed to ``FSDPStrategy`` (sharding_strategy, state_dict_type, cpu_offload, …).
    """
    from hydra.utils import get_class
    from lightning.pytorch.strategies import FSDPStrategy

    layers = {get_class(name) for name in wrap_layers}
    if activation_checkpointing:
        kwargs["activation_checkpointing_policy"] = layers
    return FSDPStrategy(auto_wrap_policy=layers, **kwargs)
