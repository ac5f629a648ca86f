"""lit_rlhf's one entry point: ``python train.py algo=… model=… data=… strategy=…``.

Composes ``conf/train.yaml`` with Hydra, runs the job (lit_rlhf/launch/runner.py) and returns the
metric named by ``optimized_metric`` so that sweepers (``-m``, Optuna) can optimize it.
``--plan`` (= ``memory_plan.only=true``) prints the job's per-GPU memory plan instead of running it.
"""

import os
import sys
from pathlib import Path

# conf/paths/default.yaml resolves every path from the repository root
os.environ.setdefault("LIT_RLHF_ROOT", str(Path(__file__).resolve().parent))

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
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


if __name__ == "__main__":
    from lit_rlhf.launch.cli import prepare
    from lit_rlhf.launch.schemas import register
    from lit_rlhf.utils.config import ConfigError

    register()  # the typed configs' defaults as Hydra schemas (conf/algo/*.yaml start from them)
    try:  # an unknown key gets the allowed keys, not Hydra's "Key 'x' is not in struct"
        sys.argv[1:] = prepare(sys.argv[1:], Path(__file__).resolve().parent / "conf")
    except ConfigError as err:
        sys.exit(f"Configuration error: {err}")
    main()
