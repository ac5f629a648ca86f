"""Strategies as the stages use them: an FSDP factory (layer classes YAML cannot spell), and the
DeepSpeed strategy with what ZeRO-3 needs (whole-model build, gathered exports and rollouts;
docs/scaling.md §4). Everything here that touches DeepSpeed's internals is in this module."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from lightning.pytorch.strategies import DeepSpeedStrategy


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



class RLHFDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` for RLHF stages (docs/scaling.md §4), every ZeRO stage.

    * Models are built whole on every rank (no ``deepspeed.zero.Init`` around
      ``configure_model``): transformers' construction fails inside it, and the frozen reference
      and reward models, which DeepSpeed does not wrap, must stay whole. ``deepspeed.initialize``
      then partitions the trained models under ZeRO-3. Cost: each rank holds a full copy of the
      weights in host memory while building.
    * ``lightning_module_state_dict`` gathers ZeRO-3 partitions (a collective; only rank zero
      keeps the copy), so exports write whole weights.
    """

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        self._init_config_if_needed()
        yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.zero_stage_3:
            return super().lightning_module_state_dict()
        import deepspeed

        module = self.lightning_module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if not self.is_global_zero:
                return {}
            return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


@contextlib.contextmanager
def zero3_gathered(engine: Any) -> Iterator[None]:
    """Sampling from a ZeRO-3 engine's models (docs/scaling.md §4): gather every partition of the
    engine's module once, remove the engine's per-module hooks (which would release the weights
    after each submodule's forward and fetch them again at the next decoding step), run without
    gradients, then register the hooks again and re-partition. Costs the trained models' whole
    weights on every rank for the duration (the rollout), like DeepSpeed-Chat's hybrid engine.
    Uses DeepSpeed's ``parameter_offload`` hook lists (deepspeed is pinned; tested on CPU)."""
    import deepspeed
    import torch

    module = engine.module
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    params = list(module.parameters())
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if offload is not None:
            for p in params:
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if offload is not None:
                offload._register_deepspeed_module(offload.module)
