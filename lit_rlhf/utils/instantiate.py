"""Build the third-party pieces of a run (callbacks, loggers, strategy) from Hydra nodes."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from lit_rlhf.utils.config import check_call_arguments

log = logging.getLogger(__name__)


def _named_nodes(node: Any, group: str) -> list[tuple[str, Any]]:
    """``{name: {_target_: …}}`` entries of a group, skipping disabled (null) ones."""
    if node is None:
        return []
    if not isinstance(node, DictConfig):
        raise TypeError(f"{group} config must be a mapping of name -> {{_target_: ...}}, got {type(node).__name__}")
    out = []
    for name, sub in node.items():
        if sub is None:
            continue
        if not isinstance(sub, DictConfig) or "_target_" not in sub:
            raise TypeError(f"{group}.{name} must have a _target_")
        out.append((str(name), sub))
    return out


def instantiate_node(node: Any, key: str, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of ``node`` (the config at ``key``), its keys first checked against its
    ``_target_``'s signature (:func:`lit_rlhf.utils.config.check_call_arguments`): an argument the
    target does not take (``+callbacks.model_checkpoint.save_lst=true``) is a :class:`ConfigError`
    naming ``<key>.<argument>`` and the closest argument it takes."""
    from hydra.utils import get_method, instantiate

    if isinstance(node, DictConfig) and "_target_" in node:
        check_call_arguments(get_method(str(node._target_)), node, key)
    return instantiate(node, **kwargs)


def instantiate_callbacks(node: Any) -> list[Any]:
    return [instantiate_node(sub, f"callbacks.{name}") for name, sub in _named_nodes(node, "callbacks")]


def instantiate_loggers(node: Any) -> list[Any]:
    return [instantiate_node(sub, f"logger.{name}") for name, sub in _named_nodes(node, "logger")]


def instantiate_strategy(node: Any) -> Any:
    """A strategy object from a ``_target_`` node, or a Lightning strategy name ("auto")."""
    if node is None:
        return "auto"
    if isinstance(node, str):
        return node
    return instantiate_node(node, "strategy", _convert_="all")


def loggable_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved run config as a plain dict with secret-looking values masked."""

    from lit_rlhf.utils.secrets import mask_container

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)  # present only when composed in tests; Hydra's own settings
    return mask_container(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))


def finish_loggers(loggers: list[Any]) -> None:
    """Close logger runs so that the next job of a multirun starts its own (W&B reuses one otherwise)."""
    for lg in loggers:
        try:
            lg.finalize("success")
        except Exception as err:  # a failing logger must not hide the run's result
            log.warning("could not finalize logger %s: %s", type(lg).__name__, err)
    from lit_rlhf.utils.loggers import wandb_loggers

    if wandb_loggers(loggers):
        import wandb

        if wandb.run is not None:
            wandb.finish()
