"""Logger factories with lit_rlhf's defaults (W&B online with a key, else offline in the run dir)."""

from __future__ import annotations

import os
from typing import Any


def wandb_api_key_available() -> bool:
    """True when W&B can authenticate: WANDB_API_KEY or a stored login (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import wandb

        return bool(wandb.api.api_key)
    except Exception:
        return False


def wandb_logger(save_dir: str, offline: bool | None = None, **kwargs: Any) -> Any:
    """A ``WandbLogger``; ``offline=None`` means online when an API key is set, else offline.

    Offline runs are written under ``save_dir/wandb`` (the Hydra run directory) and can be
    uploaded later with ``wandb sync``.
    """
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_api_key_available()
    os.makedirs(save_dir, exist_ok=True)
    return WandbLogger(save_dir=save_dir, offline=offline, **kwargs)
