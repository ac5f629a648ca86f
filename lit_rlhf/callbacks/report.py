"""``StabilityReport``: write ``stability.png`` (lit_rlhf/callbacks/dashboard.py) at the end of every RL fit."""

from __future__ import annotations

import logging
import os

import lightning.pytorch as pl

log = logging.getLogger(__name__)


class StabilityReport(pl.Callback):
    """At the end of fit, on rank zero, render the run's stability panels from its CSV log (the
    runner keeps one beside any logger for RL stages: lit_rlhf/launch/runner.py ``with_stability_csv``).

    Only runs that produced rollouts are reported (SFT and RM fits have no stability metrics).
    A failure to draw is logged, never raised: the run's results matter more than its picture.
    """

    def __init__(self, filename: str = "stability.png") -> None:
        self.filename = filename
        self._saw_rollout = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(outputs, dict) and "rollout" in outputs:
            self._saw_rollout = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self._saw_rollout and trainer.is_global_zero):
            return
        for lg in trainer.loggers:
            lg.save()  # flush metrics.csv
        from lit_rlhf.callbacks.dashboard import find_metrics_csv, render

        run_dir = trainer.default_root_dir
        if find_metrics_csv(run_dir) is None:
            log.info(
                "no CSV log in %s: skipping the stability PNG (train.py keeps csv/metrics.csv beside any "
                "logger; a trainer built elsewhere needs a CSVLogger)",
                run_dir,
            )
            return
        try:
            path = render([run_dir], os.path.join(run_dir, self.filename))
            log.info("stability report: %s", path)
        except Exception as err:
            log.warning("could not draw the stability report: %s", err)


PANEL_PREFIXES = (
    "stability",
    "reward",
    "policy",
    "critic",
    "perf",
    "kl_ctl",
    "ptx",
    "alarm",
    "val",
    "grpo",
    "health",
    "agent",
    "rollout",
)


class WandbPanels(pl.Callback):
    """W&B dashboard set-up at the start of an RL fit (only when W&B is a logger): every RL metric
    group (``stability/``, ``reward/``, ``policy/``, ``critic/``, ``perf/`` …, one panel section
    each) plots against ``rl/iteration``, the RL step, rather than W&B's internal step."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lit_rlhf.callbacks.protocol import RLStage
        from lit_rlhf.utils.loggers import wandb_loggers

        # only RL stages log rl/iteration: SFT and RM panels keep W&B's own step
        if not (trainer.is_global_zero and isinstance(pl_module, RLStage)):
            return
        for lg in wandb_loggers(trainer.loggers):
            run = lg.experiment
            run.define_metric("rl/iteration")
            for prefix in PANEL_PREFIXES:
                run.define_metric(f"{prefix}/*", step_metric="rl/iteration")
