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
SECRET = re.compile(
    r"api[_-]?key|secret|passw(or)?d|credential|(^|[_-])(hf|auth|access|api|bearer|wandb|github|hub)[_-]token$"
    r"|^token$",
    re.IGNORECASE,
)


def is_secret(key: object) -> bool:
    """Whether a config key (dotted or not; ``+``/``~`` prefixes allowed) names a secret."""
    return bool(SECRET.search(str(key).lstrip("+~").rsplit(".", 1)[-1]))


MASK = "***"


def top_level_hint(key: str) -> str:
    """For an unknown secret-looking key inside a typed config group (``+algo.api_key=…``: the typed
    configs have no such field), where a secret goes instead: a new top-level key."""
    name = key.rsplit(".", 1)[-1]
    if "." not in key or not is_secret(name):
        return ""
    return (
        f" A secret goes at the top level: +{name}=… (masked in .hydra/, the logged config and W&B's "
        f"command line), used where it is needed as ${{{name}}}."
    )


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


ENV = "LIT_RLHF_MASKED_SECRETS"


def _secret_values(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = f"{prefix}{k}"
            if is_secret(k) and v not in (None, "", MASK):
                out[key] = v
            else:
                out.update(_secret_values(v, f"{key}."))
    return out


def restore_secrets(cfg: Any) -> None:
    """Put back the values :class:`MaskSecrets` masked, in a process started from the masked
    ``.hydra/config.yaml``: Lightning's DDP launcher starts ranks 1… that way, and a reward
    function's API key must reach them. The values travel in the environment the ranks inherit
    (``LIT_RLHF_MASKED_SECRETS``), never in a file."""
    import json

    from omegaconf import OmegaConf, open_dict

    values = json.loads(os.environ.get(ENV) or "{}")
    with open_dict(cfg):
        for key, value in values.items():
            if OmegaConf.select(cfg, key, default=None) == MASK:
                OmegaConf.update(cfg, key, value, force_add=True)


class MaskSecrets(Callback):
    """Hydra callback (lit_rlhf/conf/hydra/default.yaml): masks the files Hydra has just written (and keeps
    the real values in this process's environment for the ranks Lightning starts from them)."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        import json

        from omegaconf import OmegaConf

        tree = OmegaConf.to_container(config, resolve=False)
        tree.pop("hydra", None)
        secrets = _secret_values(tree)
        if secrets:
            os.environ[ENV] = json.dumps(secrets)
        subdir = config.hydra.output_subdir
        if subdir is None:
            return
        folder = os.path.join(config.hydra.runtime.output_dir, subdir)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            _rewrite(os.path.join(folder, name))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _rewrite(os.path.join(config.hydra.sweep.dir, "multirun.yaml"))
