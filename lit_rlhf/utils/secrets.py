"""Secret-looking values (API keys, tokens, passwords) never reach a file the run writes.

A key whose name looks secret (``api_key``, ``wandb_api_key``, ``token``, ``secret``,
``password`` …) keeps its name and loses its value (``***``) in: the run config logged to
loggers (W&B, CSV hparams), the three files Hydra writes into ``.hydra/`` (rewritten by the
:class:`MaskSecrets` callback right after Hydra saves them), a multirun's ``multirun.yaml``, and
the command line W&B records (``sys.argv``, masked by train.py before any logger starts).
"""

from __future__ import annotations

import os
import re
from typing import Any

from hydra.experimental.callback import Callback

# Matched against a key's last name (``logger.api_key`` → ``api_key``): access tokens are named as
# such (``hf_token``, ``token``), so ``max_new_tokens``, ``pad_token`` or ``tokenizer`` keep their values.
SECRET = re.compile(r"api[_-]?key|secret|passw(or)?d|credential|(^|[_-])(hf|auth|access|api|bearer|wandb|github|hub)[_-]token$"
                    r"|^token$", re.IGNORECASE)


def is_secret(key: object) -> bool:
    """Whether a config key (dotted or not; ``+``/``~`` prefixes allowed) names a secret."""
    return bool(SECRET.search(str(key).lstrip("+~").rsplit(".", 1)[-1]))
MASK = "***"


def mask_override(override: str) -> str:
    """``+wandb_api_key=abc`` → ``+wandb_api_key=***``; other overrides unchanged."""
    key, sep, value = override.partition("=")
    return f"{key}{sep}{MASK}" if sep and value and is_secret(key) else override


def mask_container(obj: Any) -> Any:
    """A plain dict/list tree with every secret-looking key's value replaced by ``***``; override
    strings (``key=value``) in lists are masked too."""
    if isinstance(obj, dict):
        return {k: (MASK if is_secret(k) and v not in (None, "") else mask_container(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [mask_container(v) for v in obj]
    if isinstance(obj, str):
        return mask_override(obj)
    return obj


def _rewrite(path: str) -> None:
    from omegaconf import OmegaConf

    if os.path.isfile(path):
        masked = mask_container(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
        with open(path, "w") as fh:
            fh.write(OmegaConf.to_yaml(OmegaConf.create(masked)))


class MaskSecrets(Callback):
    """Hydra callback (conf/hydra/default.yaml): masks the files Hydra has just written."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        subdir = config.hydra.output_subdir
        if subdir is None:
            return
        folder = os.path.join(config.hydra.runtime.output_dir, subdir)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            _rewrite(os.path.join(folder, name))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _rewrite(os.path.join(config.hydra.sweep.dir, "multirun.yaml"))
