"""DeepSpeed internals (pinned deepspeed==0.19.8; lit_rlhf/utils/compat/__init__.py): ZeRO-3's
per-module parameter hooks, removed for a rollout and registered again after it."""

from __future__ import annotations

from typing import Any

from lit_rlhf.utils.compat import private_attr


def zero3_offload(engine: Any) -> Any:
    """The engine optimizer's ``parameter_offload`` (the owner of ZeRO-3's fetch/release hooks), or
    None (not ZeRO-3)."""
    return getattr(getattr(engine, "optimizer", None), "parameter_offload", None)


def remove_zero3_hooks(offload: Any) -> None:
    """Remove every forward/backward hook ZeRO-3 put on the module tree (the weights are gathered once instead)."""
    hooks = private_attr(offload, "forward_hooks", "deepspeed", "DeepSpeedZeRoOffload.forward_hooks")
    hooks = hooks + private_attr(offload, "backward_hooks", "deepspeed", "DeepSpeedZeRoOffload.backward_hooks")
    for hook in hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def register_zero3_hooks(offload: Any) -> None:
    """Put ZeRO-3's hooks back on the module tree (DeepSpeed's own registration)."""
    register = private_attr(
        offload, "_register_deepspeed_module", "deepspeed", "DeepSpeedZeRoOffload._register_deepspeed_module"
    )
    register(offload.module)
