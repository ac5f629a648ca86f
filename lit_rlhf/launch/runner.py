"""One training job from a composed Hydra config: validate → build → fit (→ test) → metrics.

``train.py`` is only the Hydra entry point around :func:`run`; tests call :func:`run` with a
config composed from ``lit_rlhf/conf/`` (tests/conftest.py).

Order matters: a job's missing inputs and its stage config (algo) are checked before torch and
Lightning are imported (:func:`check_before_imports`: train.py answers in about a second), then every
user-facing config (model, algo, data, trainer) is validated into its dataclass, so a typo or an
out-of-range value fails before a tokenizer, a dataset or a model is built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.utils.config import ConfigError, build_config, check_call_arguments

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """The validated pieces of a job (cheap: no weights, no data yet).

    A stage job has ``algo_cls`` (an :class:`~lit_rlhf.modules.base.RLHFModule`) with its config
    and data; a pipeline job (``algo`` not chosen: ``python train.py`` runs ``pipeline=demo``) has
    only ``pipeline``/``pipeline_cls``.
    """

    model: ModelSpec
    algo_cls: type | None = None
    algo: Any = None
    data_cls: type | None = None
    data: Any = None
    pipeline_cls: type | None = None
    pipeline: Any = None


def model_node(node: Any, policy_path: str | None = None) -> Any:
    """``cfg.model`` with a given ``name_or_path`` winning over a tiny config's ``tiny`` (and its
    ``tokenizer: synthetic`` / ``train_tokenizer``): ``model.name_or_path=<run>/sft/policy`` on top
    of ``model=tiny_llama`` loads the saved model and the tokenizer saved beside it. A model group
    without weights of its own (``model=hf``) takes the stage's ``algo.policy_path`` for them."""
    from omegaconf import open_dict

    if isinstance(node, DictConfig) and node.get("name_or_path") is None and node.get("tiny") is None and policy_path:
        node = node.copy()
        with open_dict(node):
            node.name_or_path = policy_path
        return node
    if not isinstance(node, DictConfig) or node.get("name_or_path") is None or node.get("tiny") is None:
        return node
    node = node.copy()
    with open_dict(node):
        node.tiny, node.train_tokenizer = None, None
        if node.get("tokenizer") == "synthetic":
            node.tokenizer = None
    log.info(
        "model.name_or_path=%s is set: the tiny config's model.tiny (and its tokenizer) are not used", node.name_or_path
    )
    return node


def get_class(node: Any, key: str) -> type:
    """The class a config node's ``_target_`` names; a :class:`ConfigError` naming ``key`` if it
    has none or it cannot be imported."""
    from hydra.utils import get_class as hydra_get_class

    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(key, "must be a mapping with a _target_ class")
    try:
        return hydra_get_class(node._target_)
    except Exception as err:
        raise ConfigError(f"{key}._target_", f"cannot import '{node._target_}': {err}") from None


def memory_plan(cfg: DictConfig, job: Plan | None = None) -> Any:
    """The per-GPU memory plan of a stage job (lit_rlhf/launch/memory_plan.py), None for pipelines."""
    from lit_rlhf.launch.memory_plan import gpu_memory_gb, plan_for, plan_settings

    job = job or plan(cfg)
    if job.algo_cls is None:
        return None
    return plan_for(cfg, job, gpu_memory_gb(cfg), plan_settings(cfg).reserve_gb)


def print_memory_plan(cfg: DictConfig) -> bool | None:
    """``train.py --plan``: print the plan; returns whether it fits (None: no GPU memory to check)."""
    try:
        p = memory_plan(cfg)
    except ConfigError:
        raise  # a bad value (memory_plan.*, or any key): the caller names it
    except ValueError as err:  # an architecture not readable here (hub id without a local config.json)
        print(f"No memory plan: {err}. Point model.name_or_path (and the algo.*_path keys) at local folders.")
        return None
    if p is None:
        print("The pipeline runs several stages: plan one stage at a time (algo=…, or experiment=…).")
        return None
    print(p.render())
    return p.fits


def check_memory_plan(cfg: DictConfig, job: Plan) -> None:
    """Refuse a GPU launch that the memory plan says cannot fit (``memory_plan.enforce``)."""
    from lit_rlhf.launch.memory_plan import plan_settings

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator not in ("gpu", "cuda") or not plan_settings(cfg).enforce or job.algo_cls is None:
        return
    try:
        p = memory_plan(cfg, job)
    except ConfigError:
        raise
    except ValueError as err:  # unknown architecture offline: no plan, no refusal
        log.warning("memory plan skipped: %s", err)
        return
    if p is not None and p.fits is False:
        raise ConfigError(
            "memory_plan",
            "this job does not fit the GPU memory (set memory_plan.enforce=false to launch anyway):\n" + p.render(),
        )


def plan(cfg: DictConfig) -> Plan:
    """Validate the model, algo and data configs into dataclasses; raise ConfigError on any problem."""
    from lit_rlhf.launch.memory_plan import plan_settings
    from lit_rlhf.modules.base import RLHFModule

    plan_settings(cfg)  # memory_plan.* checked on every machine, not only where a GPU plan is made
    model = build_config(ModelSpec, model_node(cfg.model, (cfg.get("algo") or {}).get("policy_path")), "model")
    if cfg.get("trainer") is not None:
        import lightning.pytorch as pl

        check_call_arguments(pl.Trainer.__init__, cfg.trainer, "trainer")
    if cfg.get("algo") is None:
        if cfg.get("pipeline") is None:
            raise ConfigError(
                "algo",
                "choose a stage (algo=sft, rm, ppo, …: the files in lit_rlhf/conf/algo) or a "
                "pipeline (pipeline=demo, what `python train.py` runs by default)",
            )
        pipeline_cls = get_class(cfg.pipeline, "pipeline")
        return Plan(
            model, pipeline_cls=pipeline_cls, pipeline=build_config(pipeline_cls.config_class, cfg.pipeline, "pipeline")
        )
    algo_cls = get_class(cfg.algo, "algo")
    if not (isinstance(algo_cls, type) and issubclass(algo_cls, RLHFModule)):
        raise ConfigError("algo._target_", f"{cfg.algo._target_} is not a lit_rlhf stage (an RLHFModule subclass)")
    algo = build_config(algo_cls.config_class, cfg.algo, "algo")
    kind = algo_cls.data_kind
    if cfg.get("data") is None or kind not in cfg.data:
        have = [k for k in (cfg.get("data") or {}) if isinstance(cfg.data[k], DictConfig) and "_target_" in cfg.data[k]]
        raise ConfigError(
            f"data.{kind}",
            f"the selected data config has no '{kind}' section, which {algo_cls.__name__} needs "
            f"(it has: {', '.join(have) or 'none'}); choose another data=… or add data.{kind}",
        )
    data_cls = get_class(cfg.data[kind], f"data.{kind}")
    data = algo_cls.resolve_data_config(algo, build_config(data_cls.config_class, cfg.data[kind], f"data.{kind}"))
    model = algo_cls.resolve_model_spec(algo, model)
    algo_cls.check_compatible(algo, model)
    from lit_rlhf.launch.strategy import strategy_kind

    if model.lora.enabled and strategy_kind(cfg)[0] == "fsdp":
        raise ConfigError(
            "strategy",
            "model.lora.enabled=true with strategy=fsdp is not supported (the RL stages' "
            "LoRA reference, the actor with its adapters off, would call the actor's "
            "modules around the FSDP units that gather their weights; the other stages "
            "are untested there); use strategy=deepspeed_stage_2/3, or auto/ddp",
        )
    return Plan(model, algo_cls, algo, data_cls, data)


def _resolve_auto_monitor(callbacks_cfg: Any, algo_cls: type) -> Any:
    """``monitor: auto`` in a checkpoint callback → the stage's own metric and mode
    (``algo_cls.monitor``, e.g. ("val/accuracy", "max") for the reward model)."""
    from omegaconf import open_dict

    if not isinstance(callbacks_cfg, DictConfig):
        return callbacks_cfg
    callbacks_cfg = callbacks_cfg.copy()
    with open_dict(callbacks_cfg):
        for node in callbacks_cfg.values():
            if isinstance(node, DictConfig) and node.get("monitor") == "auto":
                metric, mode = algo_cls.monitor
                node.monitor, node.mode = metric, mode
    return callbacks_cfg


def build(cfg: DictConfig, p: Plan | None = None) -> tuple[Plan, Any, Any]:
    """Validate (unless ``p``, the job's plan, is given), seed, and build the data module and the
    LightningModule (weights still unbuilt)."""
    import lightning.pytorch as pl

    from lit_rlhf.data.tokenizers import build_tokenizer

    p = p or plan(cfg)
    p.algo_cls.check_paths(p.algo)  # a missing/empty model folder names its algo.* key, not model.name_or_path
    if cfg.get("test", False) and "test_step" not in vars(p.algo_cls):
        raise ConfigError("test", f"{p.algo_cls.__name__} has no test loop; run with test=false")
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    tokenizer = build_tokenizer(p.model)
    datamodule = p.data_cls(p.data).connect(tokenizer, kind=p.model.kind)
    module = p.algo_cls(p.algo, model=p.model, tokenizer=tokenizer)
    return p, datamodule, module


def build_trainer(cfg: DictConfig, algo_cls: type) -> tuple[Any, list[Any]]:
    """(trainer, loggers) of a stage job: its callbacks plus the progress bar and ResumeState, its
    strategy with atomic checkpoint saving (a kill never destroys last.ckpt, file or folder)."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ProgressBar

    from lit_rlhf.callbacks.progress import RLProgressBar
    from lit_rlhf.callbacks.resume import ResumeState
    from lit_rlhf.runtime.checkpoint_io import AtomicCheckpointIO, atomic_deepspeed_saves
    from lit_rlhf.utils.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_strategy

    callbacks = instantiate_callbacks(_resolve_auto_monitor(cfg.get("callbacks"), algo_cls))
    if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(RLProgressBar())  # RL stages count iterations and optimizer steps, not epochs
    if not any(isinstance(c, ResumeState) for c in callbacks):
        callbacks.append(ResumeState())  # exact resume: sampling continues where the killed run was
    loggers = with_stability_csv(instantiate_loggers(cfg.get("logger")), callbacks, algo_cls, cfg.trainer)
    strategy = instantiate_strategy(cfg.get("strategy"))
    if _manages_own_checkpoints(strategy):
        atomic_deepspeed_saves(strategy)  # DeepSpeed writes folders itself: no CheckpointIO applies
        plugins = []
    else:
        plugins = [AtomicCheckpointIO()]
    # trainer.* were checked against Trainer's signature by plan()
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, strategy=strategy, plugins=plugins)
    return trainer, loggers


def with_stability_csv(loggers: list[Any], callbacks: list[Any], algo_cls: type, trainer_cfg: Any) -> list[Any]:
    """``loggers`` plus a CSV log (``<run>/csv/metrics.csv``) when an RL stage draws its stability
    PNG (StabilityReport reads that file) and no CSV logger is configured: the PNG exists whatever
    the logger (``logger=wandb``, ``tensorboard``, ``none``)."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_rlhf.callbacks.csv_log import RunCSVLogger
    from lit_rlhf.callbacks.report import StabilityReport
    from lit_rlhf.modules.rl import RLModule

    wanted = issubclass(algo_cls, RLModule) and any(isinstance(c, StabilityReport) for c in callbacks)
    if not wanted or any(isinstance(lg, CSVLogger) for lg in loggers):
        return loggers
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    save_dir = trainer_cfg.get("default_root_dir") or os.getcwd()  # the run directory StabilityReport reads
    if rank_zero_only.rank == 0:
        log.info(
            "stability.png reads a CSV log: keeping %s beside the configured logger(s)",
            os.path.join(save_dir, "csv", "metrics.csv"),
        )
    return [*loggers, RunCSVLogger(save_dir=save_dir, name="csv", version="")]


def resume_path(trainer: Any, ckpt_path: str | None) -> str | None:
    """``ckpt_path`` for ``trainer.fit``, with ``last`` resolved here and said in one log line: the
    newest ``last*.ckpt`` of this run's checkpoint folder, or None (a fresh start: the first launch
    of a job that a requeue will resume) when the folder holds none yet."""
    if ckpt_path != "last":
        return ckpt_path
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_rlhf.utils.compat.lightning import last_checkpoints

    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    found = {p for c in callbacks for p in last_checkpoints(c, trainer)}  # what Lightning's "last" looks at
    folders = sorted({str(c.dirpath) for c in callbacks if c.dirpath}) or ["(no ModelCheckpoint folder)"]
    if not found:
        if trainer.is_global_zero:
            log.info(
                "ckpt_path=last: %s holds no checkpoint yet: this run starts from step 0 (to resume an earlier "
                "run: hydra.run.dir=<its run dir> ckpt_path=last, or ckpt_path=<its checkpoints/last.ckpt>)",
                ", ".join(folders),
            )
        return None
    newest = max(found, key=os.path.getmtime)
    if trainer.is_global_zero:
        log.info("ckpt_path=last: resuming from %s", newest)
    return newest


def check_before_imports(cfg: DictConfig) -> None:
    """What a stage job's config can fail on before torch, transformers and Lightning are imported
    (~9 s of CPU in a fresh process; train.py then answers in about a second): every input it lacks
    here, in one message (lit_rlhf/launch/preflight.py), then the stage's config (``algo.*``) into its
    dataclass. lit_rlhf's stages are known by name (launch/schemas.py); a stage of the user's own is
    imported for its data section, and its config is checked by :func:`plan`, which checks the
    stage's config again (cheap) with the model, data and trainer configs."""
    if cfg.get("algo") is None:
        return
    from lit_rlhf.launch.preflight import check_inputs
    from lit_rlhf.launch.schemas import STAGE_DATA_KINDS, STAGE_SCHEMAS, schema_class

    target = str(cfg.algo.get("_target_", "")) if isinstance(cfg.algo, DictConfig) else ""
    if target not in STAGE_SCHEMAS:
        check_inputs(cfg, getattr(get_class(cfg.algo, "algo"), "data_kind", ""))
        return
    schema = STAGE_SCHEMAS[target]
    check_inputs(cfg, STAGE_DATA_KINDS[schema])
    build_config(schema_class(schema), cfg.algo, "algo")


def run(cfg: DictConfig) -> dict[str, float]:
    """Run one job; returns the final ``trainer.callback_metrics`` as floats."""
    check_before_imports(cfg)
    from lit_rlhf.runtime.checkpoint_io import check_checkpoint_path
    from lit_rlhf.utils.instantiate import finish_loggers, loggable_config

    try:  # per-shard "Loading weights" bars drown the training log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    p = plan(cfg)
    if p.pipeline_cls is not None:
        return p.pipeline_cls(p.pipeline).run(cfg)
    check_checkpoint_path(cfg.get("ckpt_path"))
    check_memory_plan(cfg, p)  # before any weight is loaded
    p, datamodule, module = build(cfg, p)
    trainer, loggers = build_trainer(cfg, p.algo_cls)
    try:
        for lg in loggers:
            lg.log_hyperparams(loggable_config(cfg))
        metrics = _fit_and_test(cfg, trainer, module, datamodule)
    finally:
        finish_loggers(loggers)
    if trainer.is_global_zero:
        log.info("final metrics: %s", ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        export_dir = p.algo.export_dir
        if export_dir and cfg.get("train", True):
            log.info("model saved (save_pretrained) to %s", export_dir)
    return metrics


def _scalars(trainer: Any) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def _fit_and_test(cfg: DictConfig, trainer: Any, module: Any, datamodule: Any) -> dict[str, float]:
    """The job's loops: the optional baseline validation, fit (plus a final validation when the fit
    logged no ``optimized_metric``), the optional test; returns the final metrics."""
    if cfg.get("validate_before_fit", False):
        # the starting point (e.g. the SFT policy's reward) in the same logs as the run
        baseline = trainer.validate(module, datamodule=datamodule, verbose=False)
        if baseline and trainer.is_global_zero:
            log.info("before fit: %s", ", ".join(f"{k}={v:.4g}" for k, v in sorted(baseline[0].items())))
    if cfg.get("train", True):
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_path(trainer, cfg.get("ckpt_path")))
    metrics = _scalars(trainer)
    if cfg.get("train", True) and _validate_for_metric(trainer, module, datamodule, cfg.get("optimized_metric")):
        metrics.update(_scalars(trainer))
    if cfg.get("test", False):
        # the best checkpoint of this fit when one was kept, else the weights as they are
        ckpt = cfg.get("ckpt_path")
        if cfg.get("train", True):
            ckpt = "best" if trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path else None
        trainer.test(module, datamodule=datamodule, ckpt_path=ckpt)
        metrics.update(_scalars(trainer))
    return metrics


def _validate_for_metric(trainer: Any, module: Any, datamodule: Any, name: str | None) -> bool:
    """A final validation when the fit ended before its first one (a short ``trainer.max_steps``)
    and so never logged ``optimized_metric``: the sweeper gets the metric of the weights trained.
    Returns whether it ran."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not name or name in trainer.callback_metrics or trainer.interrupted:
        return False
    if not is_overridden("validation_step", module):
        return False
    if trainer.is_global_zero:
        log.info(
            "optimized_metric %s was not logged during the fit (no validation ran before the budget ended, "
            "trainer.max_steps=%s): running a final validation",
            name,
            trainer.max_steps,
        )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return True


def _manages_own_checkpoints(strategy: Any) -> bool:
    """DeepSpeed writes checkpoint folders itself (no CheckpointIO plugin applies)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy)


def metric_value(metrics: dict[str, float], name: str | None) -> float | None:
    """The value a sweeper optimizes. A metric the finished run never logged (even after the final
    validation) is an error line and NaN, never a failed run: its export is kept, the other jobs of
    a sweep still run, and Optuna records the trial as failed."""
    if name is None:
        return None
    if name not in metrics:
        log.error(
            "optimized_metric: '%s' was not logged by this run (the sweeper gets NaN); logged: %s",
            name,
            ", ".join(sorted(metrics)) or "none",
        )
        return float("nan")
    return metrics[name]
