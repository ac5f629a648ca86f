"""lit_rlhf's one entry point: ``python train.py algo=… model=… data=… strategy=…``.

Composes ``conf/train.yaml`` with Hydra, runs the job (lit_rlhf/runner.py) and returns the
metric named by ``optimized_metric`` so that sweepers (``-m``, Optuna) can optimize it.
"""

import os
import sys
from pathlib import Path

# conf/paths/default.yaml resolves every path from the repository root
os.environ.setdefault("LIT_RLHF_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

PLAN_ONLY = False  # `--plan`: print the memory plan of the composed job and exit (lit_rlhf/memory_plan.py)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lit_rlhf.data.io import DataError
    from lit_rlhf.models.builders import ModelLoadError
    from lit_rlhf.modules.health import NonFiniteTrainingError
    from lit_rlhf.rollout.score import RewardFunctionError
    from lit_rlhf.runner import metric_value, run
    from lit_rlhf.utils.config import ConfigError

    from lit_rlhf.utils.console import one_line_per_event
    from lit_rlhf.utils.secrets import mask_override, restore_secrets

    one_line_per_event()  # Lightning's own console handler off (Hydra's prints it), ads and known warnings filtered
    restore_secrets(cfg)  # DDP ranks 1… start from the masked .hydra/config.yaml
    sys.argv[1:] = [mask_override(a) for a in sys.argv[1:]]  # loggers (W&B) record the command line
    try:
        if PLAN_ONLY:
            from lit_rlhf.runner import print_memory_plan

            sys.exit(0 if print_memory_plan(cfg) is not False else 2)
        metrics = run(cfg)
        return metric_value(metrics, cfg.get("optimized_metric"))
    except ConfigError as err:
        # a user mistake: say which key and what is allowed, without a traceback
        sys.exit(f"Configuration error: {err}")
    except (DataError, ModelLoadError, RewardFunctionError, NonFiniteTrainingError) as err:
        sys.exit(f"Error: {err}")


if __name__ == "__main__":
    from lit_rlhf.launch.cli import check_overrides, plan_only_overrides, without_unused_pipeline
    from lit_rlhf.utils.config import ConfigError
    from lit_rlhf.launch.schemas import register

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
