"""OmegaConf internals (pinned omegaconf==2.3.1; lit_rlhf/utils/compat/__init__.py)."""

from __future__ import annotations

from typing import Any

from lit_rlhf.utils.compat import private_attr


def raw_node(node: Any, key: str) -> Any:
    """The child node ``key`` of a DictConfig WITHOUT resolving interpolations (``node[key]`` would
    resolve ``${…}``, which may need values the command line has not set yet)."""
    get = private_attr(node, "_get_node", "omegaconf", "DictConfig._get_node")
    return get(key)
