"""Lightning internals (pinned lightning==2.6.6; lit_rlhf/utils/compat/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lit_rlhf.utils.compat import private_attr


def combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` (None before the fit loop set it up): the object whose
    loaders the exact-resume callback restores (lit_rlhf/callbacks/resume.py)."""
    return private_attr(trainer.fit_loop, "_combined_loader", "lightning", "Trainer.fit_loop._combined_loader")


def last_checkpoints(callback: Any, trainer: Any) -> set[str]:
    """The ``last*.ckpt`` files a ``ModelCheckpoint`` would resume from with ``ckpt_path="last"``
    (Lightning's own lookup, so that the log line names what Lightning would load)."""
    find = private_attr(callback, "_find_last_checkpoints", "lightning", "ModelCheckpoint._find_last_checkpoints")
    return set(find(trainer))


def record_device(module: Any, device: torch.device) -> None:
    """Set what ``LightningModule.device`` reports (``_DeviceDtypeModuleMixin._device``) when a
    strategy placed the parameters itself instead of calling ``module.to``."""
    private_attr(module, "_device", "lightning", "LightningModule._device")  # fails loudly if the mixin moved
    module._device = device


#: the FSDPStrategy method lit_rlhf's RLHFFSDPStrategy overrides to wrap the model's units itself
FSDP_SETUP_MODEL = "_setup_model"


def check_fsdp_setup_model() -> None:
    """Raise if ``FSDPStrategy`` no longer has the method RLHFFSDPStrategy overrides (an
    override of a vanished method would silently never run)."""
    from lightning.pytorch.strategies import FSDPStrategy

    private_attr(FSDPStrategy, FSDP_SETUP_MODEL, "lightning", f"FSDPStrategy.{FSDP_SETUP_MODEL}")


def wrap_save_checkpoint(strategy: Any, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``strategy.save_checkpoint`` on this instance by ``wrapper(original)`` (DeepSpeed
    writes checkpoint folders itself, outside any CheckpointIO: the one place to make them atomic)."""
    original = private_attr(strategy, "save_checkpoint", "lightning", f"{type(strategy).__name__}.save_checkpoint")
    strategy.save_checkpoint = wrapper(original)


def setup_activation_checkpointing(unit: Any, strategy: Any) -> None:
    """Apply the strategy's activation-checkpointing policy to one FSDP unit, as Lightning's own
    ``FSDPStrategy._setup_model`` does for the module it wraps whole."""
    from lightning.pytorch.strategies import fsdp

    setup = private_attr(
        fsdp,
        "_setup_activation_checkpointing",
        "lightning",
        "lightning.pytorch.strategies.fsdp._setup_activation_checkpointing",
    )
    kwargs = private_attr(
        strategy, "_activation_checkpointing_kwargs", "lightning", "FSDPStrategy._activation_checkpointing_kwargs"
    )
    setup(unit, kwargs)


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """The keyword arguments a ``WandbLogger`` will pass to ``wandb.init`` (mutable: lit_rlhf drops
    Lightning's ``anonymous=None``, which wandb warns about on every run)."""
    return private_attr(logger, "_wandb_init", "lightning", "WandbLogger._wandb_init")
