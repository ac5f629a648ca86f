"""What a stage job needs from outside before it starts, checked all at once (runner.run).

A real job names weights (``model.name_or_path``, ``algo.policy_path``), a reward model or function
and data; offline, any of them can be missing. Loading them one by one would stop at the first
with a traceback (or a minute of hub retries) and hide the rest; :func:`missing_inputs` lists
every one in a single message instead: local paths that do not exist or are not exports, hub ids
(models and datasets) when the hub cannot be reached and they are not in the local cache, and an
RL stage without a reward.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

from lit_rlhf.utils.config import ConfigError

_MODEL_KEYS = ("policy_path", "reference_path", "reward_path", "critic_path")
_REWARD_KEYS = ("reward_path", "reward_fn", "reward_fns")


def hub_reachable() -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) answers a TCP connection within 3 s — or,
    behind an HTTPS proxy (``HTTPS_PROXY``/``ALL_PROXY``), the proxy does; False under
    ``HF_HUB_OFFLINE=1``. Asked anew at each call (:class:`Hub` asks once per check)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    proxy = next(
        (os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(k)), None
    )
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


class Hub:
    """The hub's reachability for one check of a job's inputs: asked at the first input that needs
    it, then remembered for the rest of that check only."""

    def __init__(self) -> None:
        self._reachable: bool | None = None

    def reachable(self) -> bool:
        if self._reachable is None:
            self._reachable = hub_reachable()
        return self._reachable


def _model_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:
        return False


def _dataset_cached(name: str) -> bool:
    """A hub dataset already in the local caches (the hub's, or ``datasets``' own)."""
    folder = os.path.join(
        os.environ.get("HF_DATASETS_CACHE")
        or os.path.join(os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "datasets"),
        name.replace("/", "___"),
    )
    if os.path.isdir(folder):
        return True
    try:
        from huggingface_hub import scan_cache_dir

        return any(r.repo_id == name and r.repo_type == "dataset" for r in scan_cache_dir().repos)
    except Exception:
        return False


def _model_problem(path: str, key: str, hub: Hub) -> str | None:
    """Why the model at ``path`` (set by ``key``) cannot be loaded here, or None."""
    from lit_rlhf.models.spec import check_model_path, is_local_path

    if path.startswith("pkg://"):
        return None
    if is_local_path(path):
        try:
            check_model_path(path, key)
        except ConfigError as err:
            return str(err)
        return None
    if _model_cached(path) or hub.reachable():
        return None
    return (
        f"{key}={path}: not a local folder, the Hugging Face hub cannot be reached (offline) and it is not in "
        f"the local cache: download it where there is network (`huggingface-cli download {path} --local-dir "
        f"/path/to/{path.rsplit('/', 1)[-1]}`) and set {key}=/path/to/{path.rsplit('/', 1)[-1]}"
    )


def _data_problem(section: Any, key: str, hub: Hub) -> str | None:
    """Why the data section's source cannot be read here, or None (embedded tasks always can)."""
    from lit_rlhf.data.io import is_file_source

    source = section.get("source")
    from lit_rlhf.data.configs import EMBEDDED_SOURCES

    if source is None or source in EMBEDDED_SOURCES:
        return None  # None: the typed config names the key itself
    if is_file_source(source):
        if os.path.exists(source):
            return None
        fallback = section.get("fallback_source")
        if fallback and hub.reachable():
            return None
        also = f" (nor can its fallback_source {fallback} be fetched: the hub is unreachable)" if fallback else ""
        return f"{key}.source={source}: no such file{also}"
    if os.path.isdir(source) or _dataset_cached(source) or hub.reachable():
        return None
    return (
        f"{key}.source={source}: not a local file or folder, and the Hugging Face hub cannot be reached "
        "(offline): save it locally (datasets' save_to_disk, or a .jsonl) and point at it"
    )


def missing_inputs(cfg: Any, data_kind: str) -> list[str]:
    """One line per input the stage job ``cfg`` (reading ``data.<data_kind>``) lacks here."""
    algo, out, hub = cfg.algo, [], Hub()
    if "reward_path" in algo and not any(algo.get(k) for k in _REWARD_KEYS):
        out.append(
            "algo.reward_path: no reward: a reward model folder (algo=rm writes <run>/reward_model), or a "
            "reward function (algo.reward_fn / algo.reward_fns); set exactly one of algo.reward_path, "
            "algo.reward_fn and algo.reward_fns"
        )
    for key in _MODEL_KEYS:
        if algo.get(key):
            out.append(_model_problem(str(algo[key]), f"algo.{key}", hub))
    model = cfg.get("model") or {}
    if not algo.get("policy_path") and model.get("name_or_path"):  # the weights the stage starts from
        out.append(_model_problem(str(model.name_or_path), "model.name_or_path", hub))
    section = (cfg.get("data") or {}).get(data_kind)
    if section is not None:
        out.append(_data_problem(section, f"data.{data_kind}", hub))
    return [line for line in out if line]


def check_inputs(cfg: Any, data_kind: str) -> None:
    """Raise one :class:`ConfigError` listing every missing input (:func:`missing_inputs`)."""
    problems = missing_inputs(cfg, data_kind)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError("", f"this job cannot start; it is missing {len(problems)} input(s):\n{lines}")
