"""lit_rlhf's one entry point: ``python train.py algo=… model=… data=… strategy=…``.

Composes ``conf/train.yaml`` with Hydra, runs the job (lit_rlhf/runner.py) and returns the
metric named by ``optimized_metric`` so that sweepers (``-m``, Optuna) can optimize it.
"""

import os
import sys
from pathlib import Path

# conf/paths/default.yaml resolves every path from the repository root
os.environ.setdefault("LIT_RLHF_ROOT", str(Path(__file__).resolve().parent))

import hydra
from omegaconf import DictConfig

PLAN_ONLY = False  # `--plan`: print the memory plan of the composed job and exit (lit_rlhf/memory_plan.py)

# the errors reported in one line without a traceback, by the module that defines each: a module is only
# in sys.modules once the job got that far, so a job that fails its first checks never imports torch
USER_ERRORS = {
    "lit_rlhf.data.io": "DataError",
    "lit_rlhf.models.builders": "ModelLoadError",
    "lit_rlhf.rollout.scorers": "RewardFunctionError",
    "lit_rlhf.modules.health": "NonFiniteTrainingError",
}


def is_user_error(err: BaseException) -> bool:
    return any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, name in USER_ERRORS.items()
        if module in sys.modules
    )


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lit_rlhf.runner import check_before_imports, metric_value, run  # torch, Lightning: imported by the job
    from lit_rlhf.utils.config import ConfigError
    from lit_rlhf.utils.console import one_line_per_event
    from lit_rlhf.utils.secrets import mask_override, restore_secrets

    restore_secrets(cfg)  # DDP ranks 1… start from the masked .hydra/config.yaml
    sys.argv[1:] = [mask_override(a) for a in sys.argv[1:]]  # loggers (W&B) record the command line
    try:
        if not PLAN_ONLY:  # a missing input or a bad algo.* value in about a second (run checks again: cheap)
            check_before_imports(cfg)
        one_line_per_event()  # Lightning's own console handler off (Hydra's prints it), ads and known warnings filtered
        if PLAN_ONLY:
            from lit_rlhf.runner import print_memory_plan

            sys.exit(0 if print_memory_plan(cfg) is not False else 2)
        metrics = run(cfg)
        return metric_value(metrics, cfg.get("optimized_metric"))
    except ConfigError as err:
        # a user mistake: say which key and what is allowed, without a traceback
        sys.exit(f"Configuration error: {err}")
    except Exception as err:
        if not is_user_error(err):
            raise
        sys.exit(f"Error: {err}")


if __name__ == "__main__":
    from lit_rlhf.launch.cli import check_overrides, plan_only_overrides, without_unused_pipeline
    from lit_rlhf.launch.schemas import register
    from lit_rlhf.utils.config import ConfigError

    register()  # the typed configs' defaults as Hydra schemas (conf/algo/*.yaml start from them)
    if "--plan" in sys.argv[1:]:
        sys.argv.remove("--plan")
        PLAN_ONLY = True
        sys.argv[1:] = plan_only_overrides(sys.argv[1:])  # a plan writes no run directory, no file
    sys.argv[1:] = without_unused_pipeline(sys.argv[1:])  # a stage chosen: no pipeline node in the job

    try:  # an unknown key gets the allowed keys, not Hydra's "Key 'x' is not in struct"
        sys.argv[1:] = check_overrides(sys.argv[1:], Path(__file__).resolve().parent / "conf")
    except ConfigError as err:
        sys.exit(f"Configuration error: {err}")
    main()
