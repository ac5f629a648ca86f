"""A stage preset's values outside a ``train.py`` job: ``preset("grpo")`` is what ``algo=grpo``
composes to (lit_rlhf/conf/algo/grpo.yaml over its typed config's schema), for building a module in Python
with the same recipe the command line gets:

    from lit_rlhf.launch.presets import preset
    from lit_rlhf.modules.critic_free import CriticFreeModule

    module = CriticFreeModule(preset("dapo", policy_path="/ckpt/sft", reward_path="/ckpt/rm"))

The values come from the one place they live (lit_rlhf/conf/algo/*.yaml); nothing here restates them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""The config tree ``lit-rlhf train`` (and train.py) composes: lit_rlhf/conf/, shipped in the package."""


def composed(name: str, conf_dir: str | Path = CONF_DIR) -> dict[str, Any]:
    """The ``algo`` node of preset ``name`` as ``algo=<name>`` composes it (one Hydra compose, about
    60 ms: a caller that builds many modules from one preset keeps the result and :func:`merged`
    its changes over copies)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from lit_rlhf.launch.schemas import register
    from lit_rlhf.utils.config import ConfigError

    register()
    conf_dir = str(Path(conf_dir).resolve())
    options = sorted(p.stem for p in (Path(conf_dir) / "algo").glob("*.yaml"))
    if name not in options:
        raise ConfigError("algo", f"no preset {name!r}; presets: {', '.join(options)}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            node = compose(f"algo/{name}").algo
    finally:
        GlobalHydra.instance().clear()
    values = OmegaConf.to_container(node, resolve=False)
    values["export_dir"] = None  # the preset's is inside a train.py run directory
    return values


def preset(name: str, overrides: Mapping[str, Any] | None = None, conf_dir: str | Path = CONF_DIR, **kw: Any) -> dict:
    """The ``algo`` node of preset ``name`` (with its ``_target_``; ``export_dir`` None), with
    ``overrides`` and keyword values merged over it (nested mappings key by key, e.g.
    ``generation={"max_new_tokens": 8}`` keeps the preset's other sampling settings)."""
    return merged(composed(name, conf_dir), {**(overrides or {}), **kw})


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``extra`` merged over it: nested mappings key by key, a mapping with
    a ``_target_`` (an object to build) and every other value replacing whole. ``base`` is unchanged."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and "_target_" not in value:
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
