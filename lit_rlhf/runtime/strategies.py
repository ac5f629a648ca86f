"""Strategies as the stages use them: FSDP with one unit per model and gathered rollouts, and the
DeepSpeed strategy with what ZeRO-3 needs (whole-model build, gathered exports and rollouts;
docs/scaling.md §4). The private APIs of Lightning and DeepSpeed they need are in lit_rlhf/utils/compat/."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lit_rlhf.utils.compat.lightning import check_fsdp_setup_model, record_device, setup_activation_checkpointing


class RLHFFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1, ``use_orig_params``) for RLHF stages (docs/scaling.md §4).

    * Every model the LightningModule holds as a child (actor, critic; the DPO/SFT policy) becomes
      its OWN root FSDP instance, with each of its transformer blocks (``wrap_layers``) a nested
      unit; the LightningModule itself is not wrapped. With one root around the whole
      LightningModule, the backward passes PPO/GRPO run inside ``training_step`` (manual
      optimization) would happen inside the root's forward, where FSDP1 never finalizes a
      backward (its post-backward callback is queued by the root's own pre-backward hook only)
      and the next backward fails. Frozen models the module keeps outside its children
      (reference, reward) stay whole on every rank, as under DeepSpeed.
    * Sampling from the sharded models gathers their weights once per rollout: :func:`fsdp_gathered`.
    * Gradient-norm clipping and the finite check use the norm across shards
      (:func:`sharded_grad_norm`); Lightning refuses norm clipping under FSDP.
    * LoRA models are refused (the adapters-off reference would call the actor's modules around
      the units that gather them; untested otherwise), and so is a module registered under two
      parents (FSDP would wrap it once and the other path would bypass its unit).

    Args:
        wrap_layers: import paths of the transformer-block classes, e.g.
            ``transformers.models.llama.modeling_llama.LlamaDecoderLayer``.
        activation_checkpointing: also checkpoint those blocks' activations.
        **kwargs: passed to ``FSDPStrategy`` (sharding_strategy, state_dict_type, cpu_offload, …).
    """

    def __init__(self, wrap_layers: Sequence[str] = (), activation_checkpointing: bool = False, **kwargs: Any) -> None:
        from hydra.utils import get_class

        if kwargs.get("auto_wrap_policy") is not None:
            raise ValueError(
                "RLHFFSDPStrategy builds its own wrapping policy: pass strategy.wrap_layers "
                "(the transformer-block classes), not auto_wrap_policy"
            )
        if str(kwargs.get("sharding_strategy", "FULL_SHARD")).upper().split(".")[-1].lstrip("_").startswith("HYBRID"):
            raise ValueError(
                "strategy.sharding_strategy: hybrid sharding is not supported by lit_rlhf's "
                "gradient-norm reduction; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD"
            )
        check_fsdp_setup_model()  # the Lightning method this class overrides must still exist
        self.wrap_layers = tuple(get_class(name) for name in wrap_layers)
        if activation_checkpointing:
            kwargs["activation_checkpointing_policy"] = set(self.wrap_layers)
        super().__init__(**kwargs)

    def fsdp_device_id(self) -> Any:
        """The ``device_id`` FSDP places its units on (the CUDA index; tests override it for CPU)."""
        return self.root_device.index

    def _setup_model(self, model: Any) -> Any:  # compat.lightning.FSDP_SETUP_MODEL, checked at __init__
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from lit_rlhf.models.lora import has_lora

        seen: dict[int, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            if id(m) in seen and any(True for _ in m.parameters(recurse=False)):
                raise ValueError(
                    f"FSDP: '{seen[id(m)]}' is also registered as '{name}': FSDP cannot shard a module with two parents"
                )
            seen.setdefault(id(m), name)
        lora = [name for name, child in model.named_children() if has_lora(child)]
        if lora:
            raise ValueError(
                f"FSDP: {lora} carry LoRA adapters, which lit_rlhf does not run under FSDP; use "
                "strategy=deepspeed_stage_2/3 or auto/ddp, or model.lora.enabled=false"
            )
        if any(True for _ in model.parameters(recurse=False)):
            raise ValueError(
                f"FSDP: {type(model).__name__} holds parameters of its own; lit_rlhf shards the models "
                "it holds as children, each its own FSDP root"
            )
        for p in model.parameters():  # FSDP turns sharded parameters into flat 1-D views: keep the shape built
            if not hasattr(p, "built_ndim"):  # (a second setup sees the flat views)
                p.built_ndim = p.ndim
        policy = ModuleWrapPolicy(set(self.wrap_layers)) if self.wrap_layers else None
        for name, child in list(model.named_children()):
            if isinstance(child, FullyShardedDataParallel) or not any(True for _ in child.parameters()):
                continue
            unit = FullyShardedDataParallel(
                module=child,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.fsdp_device_id(),
                auto_wrap_policy=policy,
                **self.kwargs,
            )
            setup_activation_checkpointing(unit, self)
            setattr(model, name, unit)
        # FSDP placed the units (on the device, or on the CPU under cpu_offload). What it would have
        # moved wrapping the LightningModule whole moves here: the other children and the module's
        # own buffers, and the ``device`` the module records (it places the frozen models)
        for child in model.children():
            if not isinstance(child, FullyShardedDataParallel):
                child.to(self.root_device)
        for name, buffer in list(model.named_buffers(recurse=False)):
            setattr(model, name, buffer.to(self.root_device))
        record_device(model, self.root_device)  # what LightningModule.to would record
        return model

    @property
    def wrapped(self) -> bool:
        """Whether :meth:`setup` has wrapped the LightningModule's models in FSDP."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.model
        return model is not None and any(isinstance(c, FullyShardedDataParallel) for c in model.children())

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank holds only its shard of every gradient after backward."""
        from torch.distributed.fsdp import ShardingStrategy

        return self.world_size > 1 and self.sharding_strategy != ShardingStrategy.NO_SHARD


@contextlib.contextmanager
def fsdp_gathered(module: Any) -> Iterator[None]:
    """Sampling from the FSDP models inside ``module`` (docs/scaling.md §4): each root gathers
    its full weights ONCE for the context (``summon_full_params``, recursively, no write-back),
    and every unit's forward runs its wrapped module directly meanwhile, instead of all-gathering
    and freeing each block's weights around every decoding step's forward; sharded again on exit.
    Without gradients. Costs the sharded models' whole weights on every rank for the duration, as
    under ZeRO-3 (:func:`zero3_gathered`)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(module)
    roots = FullyShardedDataParallel.fsdp_modules(module, root_only=True)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        device = next((p.device.type for u in roots for p in u.parameters()), "cpu")
        if torch.is_autocast_enabled(device):  # no cached low-precision copies of the gathered weights
            stack.enter_context(torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
        for root in roots:
            stack.enter_context(FullyShardedDataParallel.summon_full_params(root, recurse=True, writeback=False))
        for unit in units:
            unit.forward = unit.module.forward  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            for unit in units:
                del unit.forward


def built_ndim(p: Any) -> int:
    """A parameter's dimensionality as its model built it (``p.ndim``, except for parameters
    :class:`RLHFFSDPStrategy` has sharded into flat 1-D views: recorded before wrapping)."""
    return getattr(p, "built_ndim", p.ndim)


def sharded_grad_norm(params: Sequence[Any], strategy: Any) -> Any:
    """The global 2-norm of ``params``' gradients (an optimizer's: PPO's spans two FSDP roots,
    actor and critic, which ``FSDP.clip_grad_norm_`` of one root cannot cover). Under FSDP each
    rank holds a disjoint shard of every gradient, so the local sums of squares are all-reduced
    (on the strategy's device: offloaded gradients live on the CPU); elsewhere the gradients are
    already reduced and the local norm is the norm (``torch.nn.utils.clip_grad_norm_``'s, exactly).
    Naive equivalent (unsharded): ``torch.nn.utils.get_total_norm([p.grad for p in params])``."""
    import torch

    from lit_rlhf.utils.distributed import all_reduce_sum

    grads = [p.grad for p in params if p.grad is not None]
    norm = (torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())).to(strategy.root_device)
    if getattr(strategy, "shards_gradients", False):
        norm = all_reduce_sum(norm.float() ** 2).sqrt()
    return norm


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

    from lit_rlhf.utils.compat.deepspeed import register_zero3_hooks, remove_zero3_hooks, zero3_offload

    module = engine.module
    offload = zero3_offload(engine)
    params = list(module.parameters())
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if offload is not None:
            for p in params:
                p.ds_active_sub_modules.clear()
            remove_zero3_hooks(offload)
        try:
            yield
        finally:
            if offload is not None:
                register_zero3_hooks(offload)
