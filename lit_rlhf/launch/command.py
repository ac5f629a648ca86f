"""The package's one command: ``lit-rlhf`` (also ``python -m lit_rlhf``; train.py in a checkout).

    lit-rlhf train [overrides]       a stage (algo=…), an experiment, a pipeline (none chosen: the demo),
                                     a sweep (-m); the job's Hydra app over lit_rlhf/conf/
    lit-rlhf plan [overrides]        the job's per-GPU memory plan, nothing loaded (= train … --plan)
    lit-rlhf report RUN_DIR …        the stability dashboard of finished runs (lit_rlhf/callbacks/dashboard.py)
    lit-rlhf serve --model DIR …     a reward model behind HTTP (lit_rlhf/serve/server.py)
    lit-rlhf --help | --version

The configs ship inside the package (lit_rlhf/conf/), so the command runs from any folder and
writes its runs under the current folder (``logs/``; ``paths.root_dir``). A user's own config folder
joins the package's through Hydra's search path: ``lit-rlhf train -cd my_conf experiment=mine``
reads ``my_conf/experiment/mine.yaml`` beside the shipped experiments (docs/running.md, "Your own
config folder").

A command line that starts with an override or a flag (``lit-rlhf algo=sft``) is ``train``: Lightning's
DDP launcher starts ranks 1… with the process's own arguments, which no longer hold the word ``train``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

from lit_rlhf.launch.presets import CONF_DIR

USAGE = """usage: lit-rlhf {train,plan,report,serve} …

  lit-rlhf train [overrides]        run a stage, an experiment, a pipeline or a sweep (-m)
  lit-rlhf plan [overrides]         print the job's per-GPU memory plan and exit (nothing is loaded)
  lit-rlhf report RUN_DIR [RUN_DIR…]  the stability dashboard of finished runs
  lit-rlhf serve --model RM_DIR     serve a reward model over HTTP (OpenRLHF's /get_reward)
  lit-rlhf train --help             Hydra's help: every config group with its options
  lit-rlhf --version

examples:
  lit-rlhf train                                    the demo: SFT -> RM -> PPO, PPO-max, DPO, GRPO, DAPO (CPU)
  lit-rlhf train experiment=sft_synthetic_tiny      one stage from a shipped recipe
  lit-rlhf train algo=grpo model=hf model.name_or_path=/ckpt/sft data=chat data.path=prompts.jsonl
  lit-rlhf plan experiment=ppo_max_llama7b_a100x8   will it fit on 8 x 80 GB?
  lit-rlhf train -cd my_conf experiment=mine        a recipe from your own config folder

config groups (group=option):
"""


def config_groups(config_dir=CONF_DIR) -> dict[str, list[str]]:
    """Each config group of the package (a folder of lit_rlhf/conf/) and its options."""
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(config_dir.iterdir())
        if group.is_dir() and group.name not in ("hydra", "local")
    }


def usage() -> str:
    lines = [f"  {group:<15} {', '.join(options)}" for group, options in config_groups().items()]
    return USAGE + "\n".join(lines) + "\n"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_app(cfg: DictConfig) -> float | None:
    """The job (lit_rlhf/launch/runner.py), and the metric named by ``optimized_metric`` for sweepers
    (``-m``, Optuna) to optimize."""
    from lit_rlhf.launch.runner import (  # the job imports torch
        check_before_imports,
        metric_value,
        print_memory_plan,
        run,
    )
    from lit_rlhf.utils.config import ConfigError
    from lit_rlhf.utils.console import one_line_per_event
    from lit_rlhf.utils.errors import UserError
    from lit_rlhf.utils.secrets import mask_override, restore_secrets

    restore_secrets(cfg)  # DDP ranks 1… start from the masked .hydra/config.yaml
    sys.argv[1:] = [mask_override(a) for a in sys.argv[1:]]  # loggers (W&B) record the command line
    plan_only = bool((cfg.get("memory_plan") or {}).get("only", False))
    try:
        if not plan_only:  # a missing input or a bad algo.* value in about a second (run checks again: cheap)
            check_before_imports(cfg)
        one_line_per_event()  # Lightning's own console handler off (Hydra's prints it), ads and known warnings filtered
        if plan_only:
            sys.exit(0 if print_memory_plan(cfg) is not False else 2)
        metrics = run(cfg)
        return metric_value(metrics, cfg.get("optimized_metric"))
    except ConfigError as err:
        # a user mistake: say which key and what is allowed, without a traceback
        sys.exit(f"Configuration error: {err}")
    except UserError as err:  # bad data, a model that cannot be loaded, a failing reward function …
        sys.exit(f"Error: {err}")


def train(args: Sequence[str]) -> None:
    """Run the Hydra app on ``args`` (Hydra's own flags and overrides, plus ``--plan``), read once
    first (lit_rlhf/launch/cli.py: unknown keys refused with the allowed ones, ``--plan``)."""
    from lit_rlhf.launch.cli import prepare
    from lit_rlhf.launch.schemas import register
    from lit_rlhf.utils.config import ConfigError

    register()  # the typed configs' defaults as Hydra schemas (lit_rlhf/conf/algo/*.yaml start from them)
    try:  # an unknown key gets the allowed keys, not Hydra's "Key 'x' is not in struct"
        prepared = prepare(list(args), CONF_DIR)
    except ConfigError as err:
        sys.exit(f"Configuration error: {err}")
    sys.argv[1:] = prepared  # Hydra parses sys.argv; DDP ranks 1… are started from it
    hydra_app()


def main(argv: Sequence[str] | None = None) -> None:
    """``lit-rlhf``'s entry point (the console script and ``python -m lit_rlhf``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return
    if args[0] in ("-V", "--version"):
        from lit_rlhf import __version__

        print(f"lit_rlhf {__version__}")
        return
    command, rest = args[0], args[1:]
    if command == "train":
        train(rest)
    elif command == "plan":
        train([*rest, "--plan"])
    elif command == "report":
        from lit_rlhf.callbacks.dashboard import main as report

        report(rest, prog="lit-rlhf report")
    elif command == "serve":
        from lit_rlhf.serve import main as serve

        serve(rest)
    elif "=" in command or command.startswith("-"):  # overrides without the word: train (DDP ranks 1…)
        train(args)
    else:
        sys.exit(f"lit-rlhf: unknown command {command!r}; choose train, plan, report or serve (lit-rlhf --help)")
