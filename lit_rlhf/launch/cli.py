"""A pre-check of ``train.py``'s command-line overrides, before Hydra composes the config.

Hydra refuses ``algo.lrr=0.1`` (a key the composed config does not have) with its own message,
"Key 'lrr' is not in struct", which names neither the config class nor the allowed keys. This
check composes the config with the command line's group choices only (``algo=…``,
``experiment=…``; every value of a swept choice), looks up every ``key=value`` override, and
turns an unknown key into the same :class:`ConfigError` the typed configs raise:
``algo.lrr: unknown key for SFTConfig. Did you mean 'lr'? Allowed keys: …``.

Every typed key is in the composed config (the presets start from the typed configs' schemas,
lit_rlhf/launch/schemas.py), so a key is known exactly when its dataclass has the field.
Anything it cannot judge (a parse error, ``+``/``++``/``~`` overrides, ``hydra.*`` keys, list
indices) is left to Hydra, which reports it as before.
"""

from __future__ import annotations

import difflib
import itertools
from pathlib import Path
from typing import Any

from lit_rlhf.utils.compat.omegaconf import raw_node
from lit_rlhf.utils.config import ConfigError

_MAX_COMBINATIONS = 16


# Hydra's flags that take a value (``--cfg job``, ``-cn train`` …): their values are not overrides
_FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}
# flags after which Hydra does something else than a run (help, completion, info): nothing to check
_FLAGS_NO_RUN = {"--help", "-h", "--hydra-help", "--version", "--shell-completion", "-sc", "--info", "-i"}


def _cli_overrides(argv: list[str]) -> list[str] | None:
    """The ``key=value`` overrides of a ``train.py`` command line (Hydra's flags skipped); None
    when the command does not run a job (``--help``, ``--info`` …)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _FLAGS_NO_RUN or arg.split("=")[0] in _FLAGS_NO_RUN:
            return None
        elif arg in _FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def _missing_key(cfg: Any, dotted: str) -> tuple[str, str, list[str]] | None:
    """(parent path, first missing segment, keys the parent has) when ``dotted`` is not in ``cfg``."""
    from omegaconf import DictConfig

    node, path = cfg, []
    for part in dotted.split("."):
        if not isinstance(node, DictConfig):
            return None  # lists, leaf values: Hydra judges
        keys = [str(k) for k in node]
        if part not in keys:
            return ".".join(path), part, keys
        node = raw_node(node, part)  # no interpolation is resolved
        path.append(part)
    return None


def _options(config_dir: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir / group).glob("*.yaml"))


def _unknown_key_error(cfg: Any, parent: str, part: str, keys: list[str], config_dir: Path) -> ConfigError:
    if not parent and (config_dir / part).is_dir():  # a group left unchosen, e.g. algo.lr=… with no stage
        return ConfigError(
            part,
            f"no {part} is chosen, so {part}.* keys cannot be set: choose one with "
            f"{part}={'|'.join(_options(config_dir, part))} (`python train.py` alone runs "
            "the demo pipeline)",
        )
    key = f"{parent}.{part}" if parent else part
    close = difflib.get_close_matches(part, keys, n=1)
    from lit_rlhf.utils.secrets import top_level_hint

    hint = (f" Did you mean '{close[0]}'?" if close else "") + top_level_hint(key)
    owner = ""
    if parent == "algo":
        from lit_rlhf.launch.schemas import STAGE_SCHEMAS, schema_class

        target = str(cfg.algo.get("_target_", ""))
        if target in STAGE_SCHEMAS:  # lit_rlhf's stages: named without importing them
            owner = f" for {schema_class(STAGE_SCHEMAS[target]).__name__}"
        else:
            from lit_rlhf.runner import get_class

            try:
                owner = f" for {get_class(cfg.algo, 'algo').config_class.__name__}"
            except Exception:  # an unknown _target_: the runner reports it later
                pass
    allowed = ", ".join(sorted(k for k in keys if not k.startswith("_")))
    return ConfigError(key, f"unknown key{owner}.{hint} Allowed keys: {allowed}")


# targets whose constructor arguments are read from their source file, not by importing them:
# importing Lightning takes ~7 s, and a trainer.* key must be judged as fast as an algo.* one
_SOURCE_SIGNATURES = {"lightning.pytorch.Trainer": ("lightning", "pytorch/trainer/trainer.py", "Trainer")}


def _source_arguments(target: str) -> list[str] | None:
    """The ``__init__`` arguments of a class in :data:`_SOURCE_SIGNATURES`, parsed from its source
    without importing its package (None: not listed, or not found there)."""
    import ast
    import importlib.util

    if target not in _SOURCE_SIGNATURES:
        return None
    package, relative, name = _SOURCE_SIGNATURES[target]
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / relative if spec else None
    if path is None or not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is not None:
                a = init.args
                return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg != "self"]
    return None


def _target_arguments(cfg: Any, parent: str) -> list[str]:
    """The named arguments of the ``_target_`` the node at ``parent`` builds (none if it has none).
    lit_rlhf's own targets are left out: their keys are their typed config's fields, and their
    constructor arguments (``config``, ``model`` …) are passed by the runner, not set by users."""
    import inspect

    from hydra.utils import get_method
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(cfg, parent) if parent else None
    if not isinstance(node, DictConfig) or "_target_" not in node or str(node._target_).startswith("lit_rlhf."):
        return []
    from_source = _source_arguments(str(node._target_))
    if from_source is not None:
        return from_source
    try:
        params = inspect.signature(get_method(node._target_)).parameters
    except Exception:  # an unimportable target: the runner reports it
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [n for n, p in params.items() if p.kind not in skip and n != "self"]


def check_overrides(argv: list[str], config_dir: str | Path, config_name: str = "train") -> list[str]:
    """Raise :class:`ConfigError` for a ``key=value`` override whose key the composed config lacks;
    return ``argv`` with ``++`` in front of the overrides of keys that a ``_target_``'s signature
    takes but its YAML does not list (so Hydra adds them instead of refusing them)."""
    overrides = _cli_overrides(argv)
    if not overrides:
        return argv
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return argv
    config_dir = Path(config_dir)
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    choices, keys = [], []
    for o in parsed:
        name = o.key_or_group
        if o.type != OverrideType.CHANGE or o.package is not None or name.split(".")[0].split("/")[0] == "hydra":
            continue
        if name.split("/")[0] in groups and "." not in name:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            choices.append([f"{name}={v}" for v in values])
        else:
            keys.append(name)
    if not keys:
        return argv
    combinations = list(itertools.islice(itertools.product(*choices), _MAX_COMBINATIONS + 1))
    if len(combinations) > _MAX_COMBINATIONS:
        return argv
    force: set[str] = set()
    for combination in combinations:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
                cfg = compose(config_name, overrides=list(combination))
        except Exception:  # a bad group choice: Hydra lists the available options itself
            return argv
        finally:
            GlobalHydra.instance().clear()
        for key in keys:
            missing = _missing_key(cfg, key)
            if missing is None:
                continue
            parent, part, known = missing
            arguments = _target_arguments(cfg, parent)  # e.g. ModelCheckpoint's, for callbacks.model_checkpoint.*
            if f"{parent}.{part}" == key and part in arguments:
                force.add(key)
            else:
                raise _unknown_key_error(cfg, parent, part, sorted(set(known) | set(arguments)), config_dir)
    return [f"++{a}" if a.split("=", 1)[0] in force else a for a in argv]


def _chooses(overrides: list[str], group: str) -> bool:
    """Whether the overrides choose an option of ``group`` (``group=x``, not ``group=null``)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == group and value not in ("", "null"):
            return True
    return False


def without_unused_pipeline(argv: list[str]) -> list[str]:
    """``argv`` plus ``pipeline=null`` when it chooses a stage (``algo=…`` or ``experiment=…``, which
    all choose one) and no pipeline: the demo pipeline's node, which only runs when no stage is
    chosen, is then not part of the job (``--cfg job`` does not print it)."""
    overrides = _cli_overrides(argv)
    if not overrides or not (_chooses(overrides, "algo") or _chooses(overrides, "experiment")):
        return argv
    if any(o.partition("=")[0].lstrip("+~") == "pipeline" for o in overrides):
        return argv
    return _with_overrides(argv, ["~pipeline"])


def _with_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """``extra`` inserted after the command line's first override (Hydra's parser takes the
    overrides as one run of arguments: appended after ``--cfg job`` they would be refused)."""
    first = next((i for i, a in enumerate(argv) if a in (_cli_overrides(argv) or [])), len(argv) - 1)
    return [*argv[: first + 1], *extra, *argv[first + 1 :]]


def plan_only_overrides(argv: list[str]) -> list[str]:
    """``train.py --plan``'s overrides: no ``.hydra/`` files, no log file, and (unless the command
    names one with ``hydra.run.dir``) no run directory: the job "runs" in the current directory."""
    extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append("hydra.run.dir=.")
    return _with_overrides(argv, extra)
