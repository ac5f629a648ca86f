"""``train.py``'s command line, read once before Hydra composes the job (:func:`prepare`).

Hydra refuses ``algo.lrr=0.1`` (a key the composed config does not have) with its own message,
"Key 'lrr' is not in struct", which names neither the config class nor the allowed keys.
:func:`check_overrides` composes the config once, with the command line's group choices
(``algo=…``, ``experiment=…``; a swept choice by its first value: the first job), looks up every
``key=value`` override, and turns an unknown key into the same :class:`ConfigError` the typed
configs raise: ``algo.lrr: unknown key for SFTConfig. Did you mean 'lr'? Allowed keys: …``.

Every typed key is in the composed config (the presets start from the typed configs' schemas,
lit_rlhf/launch/schemas.py), so a key is known exactly when its dataclass has the field. A key of a
third-party node (``trainer.*``, a callback's) that its YAML does not list is refused with Hydra's
own idiom for adding it (``+trainer.gradient_clip_algorithm=norm``); what such a key's target then
refuses is named by the runner (lit_rlhf/launch/runner.py ``plan``, lit_rlhf/utils/instantiate.py).
Anything the check cannot judge (a parse error, ``+``/``++``/``~`` overrides, ``hydra.*`` keys, list
indices) is left to Hydra.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from lit_rlhf.utils.compat.omegaconf import raw_node
from lit_rlhf.utils.config import ConfigError

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


def _user_config_dirs(argv: list[str]) -> list[Path]:
    """The config folders a command line adds to the package's (Hydra's ``--config-dir``/``-cd``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            out.append(Path(argv[i + 1]))
        elif arg.startswith("--config-dir="):
            out.append(Path(arg.partition("=")[2]))
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
            from lit_rlhf.launch.runner import get_class

            try:
                owner = f" for {get_class(cfg.algo, 'algo').config_class.__name__}"
            except Exception:  # an unknown _target_: the runner reports it later
                pass
    allowed = ", ".join(sorted(k for k in keys if not k.startswith("_")))
    node = _select(cfg, parent)
    target = str(node.get("_target_", "")) if node is not None else ""
    add = ""
    if target and not target.startswith("lit_rlhf."):
        add = f" To pass an argument of {target} that the YAML does not list: +{key}=…"
    return ConfigError(key, f"unknown key{owner}.{hint} Allowed keys: {allowed}.{add}")


def _select(cfg: Any, parent: str) -> Any:
    """The mapping node at ``parent`` (None: the root, or not a mapping)."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(cfg, parent) if parent else None
    return node if isinstance(node, DictConfig) else None


def check_overrides(argv: list[str], config_dir: str | Path, config_name: str = "train") -> None:
    """Raise :class:`ConfigError` for a ``key=value`` override whose key the config composed from
    the command line's group choices lacks (one compose; a swept choice by its first value; the
    user's config folders of ``--config-dir`` and ``hydra.searchpath`` searched as Hydra will)."""
    _check_keys(_cli_overrides(argv) or [], Path(config_dir), config_name, _user_config_dirs(argv))


def _check_keys(overrides: list[str], config_dir: Path, config_name: str, user_dirs: list[Path] = ()) -> None:
    if not overrides:
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return  # Hydra reports the parse error itself
    dirs = [config_dir, *(d for d in user_dirs if d.is_dir())]
    groups = {p.name for d in dirs for p in d.iterdir() if p.is_dir()}
    # the user's folders join the search path as --config-dir does (Hydra reports a missing one itself)
    choices = [f"hydra.searchpath=[{','.join('file://' + str(d.resolve()) for d in dirs[1:])}]"] if dirs[1:] else []
    keys = []
    for o in parsed:
        name = o.key_or_group
        if name == "hydra.searchpath" and o.type == OverrideType.CHANGE and not dirs[1:]:
            choices.append(o.input_line)  # a search path given as an override
            continue
        if o.type != OverrideType.CHANGE or o.package is not None or name.split(".")[0].split("/")[0] == "hydra":
            continue
        if name.split("/")[0] in groups and "." not in name:
            value = next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.get_value_element_as_str()
            choices.append(f"{name}={value}")
        else:
            keys.append(name)
    if not keys:
        return
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
            cfg = compose(config_name, overrides=choices)
    except Exception:  # a bad group choice: Hydra lists the available options itself
        return
    finally:
        GlobalHydra.instance().clear()
    for key in keys:
        missing = _missing_key(cfg, key)
        if missing is not None:
            raise _unknown_key_error(cfg, *missing, config_dir)


def _chooses(overrides: list[str], group: str) -> bool:
    """Whether the overrides choose an option of ``group`` (``group=x``, not ``group=null``)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == group and value not in ("", "null"):
            return True
    return False


def prepare(argv: list[str], config_dir: str | Path, config_name: str = "train") -> list[str]:
    """``train.py``'s arguments as Hydra is to parse them, read once: unknown keys refused
    (:func:`check_overrides`); a chosen stage (``algo=…`` or ``experiment=…``, which all choose one)
    without a pipeline drops the demo pipeline's node (``~pipeline``: ``--cfg job`` does not print
    it); ``--plan`` becomes ``memory_plan.only=true`` (print the job's memory plan and exit) with no
    ``.hydra/`` files, no log file and, unless the command names one with ``hydra.run.dir``, no run
    directory (the job "runs" in the current directory); ``-m`` moves before the overrides."""
    plan = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    # Hydra's parser takes its overrides as one run of arguments: `pipeline=reasoning -m seed=1,2` would be
    # refused ("unrecognized arguments: seed=1,2"), so the multirun flag goes first, wherever it was written
    multirun = [a for a in argv if a in ("-m", "--multirun")]
    argv = multirun[:1] + [a for a in argv if a not in ("-m", "--multirun")]
    overrides = _cli_overrides(argv)
    if overrides is None:  # --help, --info …: no job
        return argv
    _check_keys(overrides, Path(config_dir), config_name, _user_config_dirs(argv))
    extra = []
    chooses_stage = _chooses(overrides, "algo") or _chooses(overrides, "experiment")
    if chooses_stage and not any(o.partition("=")[0].lstrip("+~") == "pipeline" for o in overrides):
        extra.append("~pipeline")
    if plan:
        extra += ["memory_plan.only=true", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            extra.append("hydra.run.dir=.")
    if not extra:
        return argv
    # after the first override: Hydra's parser takes the overrides as one run of arguments (appended
    # after ``--cfg job`` they would be refused)
    first = next((i for i, a in enumerate(argv) if a in overrides), len(argv) - 1)
    return [*argv[: first + 1], *extra, *argv[first + 1 :]]
