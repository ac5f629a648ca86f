"""Logger factories with lit_rlhf's defaults (W&B online with a key, else offline in the run dir)."""

from __future__ import annotations

import netrc
import os
from typing import Any
from urllib.parse import urlparse


def wandb_api_key_available() -> bool:
    """True when W&B can authenticate: WANDB_API_KEY, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_logger(save_dir: str, offline: bool | None = None, **kwargs: Any) -> Any:
    """A ``WandbLogger``; ``offline=None`` means online when an API key is set, else offline.

    Offline runs are written under ``save_dir/wandb`` (the Hydra run directory) and can be
    uploaded later with ``wandb sync``. The mode is passed to ``wandb.init`` explicitly: Lightning
    only sets ``WANDB_MODE`` in the environment, which then leaks into the next multirun job.
    """
    from lightning.pytorch.loggers import WandbLogger

    from lit_rlhf.utils.compat.lightning import wandb_init_kwargs

    if offline is None:
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_api_key_available()
    os.makedirs(save_dir, exist_ok=True)
    logger = WandbLogger(save_dir=save_dir, offline=offline, mode="offline" if offline else "online", **kwargs)
    init = wandb_init_kwargs(logger)
    if init.get("anonymous") is None:  # Lightning passes anonymous=None, which wandb>=0.19 warns
        init.pop("anonymous", None)  # about on every run ("The anonymous setting has no effect")
    return logger


def wandb_loggers(loggers: Any) -> list[Any]:
    """The ``WandbLogger``s among ``loggers``."""
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in loggers if isinstance(lg, WandbLogger)]


def log_histogram(loggers: Any, name: str, values: Any, step: int, step_key: str = "trainer/global_step") -> None:
    """A histogram of ``values`` (1-D tensor) under ``name`` on every logger that draws them:
    W&B (in a row with ``step_key`` = ``step``, the step its panel plots against) and
    TensorBoard (at ``step``). CSV has none."""
    from lightning.pytorch.loggers import TensorBoardLogger

    values = values.detach().float().cpu()
    for lg in wandb_loggers(loggers):
        import wandb

        lg.experiment.log({name: wandb.Histogram(values.numpy()), step_key: step})
    for lg in loggers:
        if isinstance(lg, TensorBoardLogger):
            lg.experiment.add_histogram(name, values, step)
