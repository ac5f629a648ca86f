"""W&B dashboards, offline: in-process summary (wandb 0.31 writes no summary file offline)."""

import lightning.pytorch as pl
import pytest

from lit_rlhf.callbacks import (
    KLMonitor,
    PerplexityMonitor,
    ResponseLengthMonitor,
    RewardStatsMonitor,
    SamplesTable,
    WandbPanels,
)
from tests.helpers.ppo import data, make


@pytest.mark.slow
def test_ppo_run_fills_the_wandb_dashboard(tmp_path, tokenizer, saved_models):
    import wandb

    from lit_rlhf.utils.loggers import wandb_logger

    logger = wandb_logger(save_dir=str(tmp_path), offline=True, project="lit_rlhf_test")
    try:
        callbacks = [
            WandbPanels(),
            KLMonitor(),
            PerplexityMonitor(),
            ResponseLengthMonitor(),
            RewardStatsMonitor(),
            SamplesTable(every_n_steps=1, max_rows=2),
        ]
        trainer = pl.Trainer(
            max_steps=4,
            accelerator="cpu",
            logger=logger,
            callbacks=callbacks,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
        )
        run = logger.experiment
        defined, real_define = [], run.define_metric
        run.define_metric = lambda name, **kw: defined.append((name, kw.get("step_metric"))) or real_define(name, **kw)
        trainer.fit(make(saved_models, tokenizer, kl_coef=0.05), data(tokenizer))
        # every panel group plots against the RL step, not Lightning's step
        for prefix in ("stability", "reward", "policy", "critic", "perf"):
            assert (f"{prefix}/*", "rl/iteration") in defined, prefix
        summary = dict(run.summary)
        for key in (
            "stability/kl",
            "stability/perplexity",
            "stability/response_length",
            "reward/score_mean",
            "policy/approx_kl",
            "critic/explained_variance",
            "rl/iteration",
        ):
            assert key in summary, key
        assert summary["rl/iteration"] == 2
        assert summary["reward/score_hist"]["_type"] == "histogram"
        assert summary["samples"]["_type"] == "table-file" and summary["samples"]["nrows"] == 4  # 2 rows x 2 iterations
    finally:
        wandb.finish()


def test_run_config_is_resolved_and_has_no_secrets(tmp_path):
    from omegaconf import OmegaConf, open_dict

    from lit_rlhf.utils.instantiate import loggable_config
    from tests.conftest import compose

    cfg = compose(["logger=wandb"], tmp_path)
    with open_dict(cfg):
        cfg.logger.wandb.api_key = "sk-very-secret"
        cfg.extra = {"hf_token": "hf_abc", "token_budget": None}
    plain = loggable_config(cfg)
    assert plain["logger"]["wandb"]["api_key"] == "***" and plain["extra"]["hf_token"] == "***"
    assert plain["extra"]["token_budget"] is None  # empty values are not "secrets"
    assert plain["paths"]["output_dir"] == str(tmp_path) and "hydra" not in plain  # resolved
    assert "sk-very-secret" not in OmegaConf.to_yaml(OmegaConf.create(plain))
