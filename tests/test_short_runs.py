"""What a newcomer's first commands do (issue #27): a short budget still yields optimized_metric and
exit 0, sweeps run every job, ckpt_path=last says what it resumed, the stability PNG exists
whatever the logger, a model path wins over the tiny config, the console shows each event once."""

import csv
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from lit_rlhf.launch.runner import metric_value, plan, run
from tests.conftest import ROOT, compose

ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", LIT_RLHF_ROOT=str(ROOT))


def test_a_fit_that_ends_before_its_first_validation_validates_once_at_the_end(cfg_factory, caplog):
    """256 pairs / 32 = 8 steps an epoch, validation at the epoch's end: 2 steps never reach it.
    The final validation gives the sweeper its metric; the fit's own metrics are kept beside it."""
    with caplog.at_level(logging.INFO, logger="lit_rlhf.launch.runner"):
        metrics = run(cfg_factory("trainer.max_steps=2", "optimized_metric=val/perplexity"))
    assert "val/perplexity was not logged during the fit" in caplog.text and "running a final validation" in caplog.text
    assert metrics["val/perplexity"] > 1.0 and "train/loss" in metrics
    assert metric_value(metrics, "val/perplexity") == metrics["val/perplexity"]


def test_a_metric_never_logged_is_an_error_line_and_nan_not_a_failed_run(caplog):
    with caplog.at_level(logging.ERROR, logger="lit_rlhf.launch.runner"):
        value = metric_value({"train/loss": 1.0}, "val/perplexty")
    assert math.isnan(value)
    assert (
        "optimized_metric: 'val/perplexty' was not logged by this run (the sweeper gets NaN); logged: train/loss"
        in caplog.text
    )


def test_ckpt_path_last_in_a_new_run_directory_starts_fresh_and_says_so_then_resumes(cfg_factory, tmp_path, caplog):
    """Both branches of ``ckpt_path=last``: an empty checkpoint folder (a job's first launch) is one
    line and a fresh start; the next launch in the same run directory names the file it resumes
    and continues from its step (the CSV log keeps the first fit's steps 0-2 and goes on at 3)."""
    common = ("logger=csv", "trainer.log_every_n_steps=1", "ckpt_path=last")
    with caplog.at_level(logging.INFO, logger="lit_rlhf.launch.runner"):
        run(cfg_factory("trainer.max_steps=3", *common))
    assert (
        f"ckpt_path=last: {tmp_path / 'checkpoints'} holds no checkpoint yet: this run starts from step 0"
        in caplog.text
    )
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lit_rlhf.launch.runner"):
        run(cfg_factory("trainer.max_steps=5", *common))
    assert f"ckpt_path=last: resuming from {tmp_path / 'checkpoints' / 'last.ckpt'}" in caplog.text
    with open(tmp_path / "csv" / "metrics.csv") as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r.get("train/loss")]
    assert steps == [0, 1, 2, 3, 4]


def test_a_model_path_wins_over_the_tiny_config(tmp_path):
    """``model.name_or_path=<run>/sft/policy`` on top of model=tiny_llama (what the README's RM command
    does with the SFT export) is enough: no model.tiny=null / model.tokenizer=null needed."""
    p = plan(compose(["experiment=rm_synthetic_tiny", f"model.name_or_path={tmp_path}"], tmp_path))
    assert (p.model.name_or_path, p.model.tiny, p.model.tokenizer) == (str(tmp_path), None, None)
    explicit = plan(
        compose(["experiment=rm_synthetic_tiny", f"model.name_or_path={tmp_path}", "model.tokenizer=gpt2"], tmp_path)
    )
    assert explicit.model.tokenizer == "gpt2"  # a tokenizer named on purpose is kept


def test_rl_stages_keep_a_csv_log_beside_any_logger_and_sft_does_not_get_one(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lit_rlhf.callbacks import StabilityReport
    from lit_rlhf.launch.runner import with_stability_csv
    from lit_rlhf.modules.critic_free import CriticFreeModule
    from lit_rlhf.modules.sft import SFTModule

    trainer_cfg = {"default_root_dir": str(tmp_path)}
    tb = TensorBoardLogger(str(tmp_path))
    loggers = with_stability_csv([tb], [StabilityReport()], CriticFreeModule, trainer_cfg)
    assert loggers[0] is tb and isinstance(loggers[1], CSVLogger)
    assert os.path.normpath(loggers[1].log_dir) == str(
        tmp_path / "csv"
    )  # where StabilityReport and lit_rlhf.callbacks.dashboard look
    assert with_stability_csv([], [StabilityReport()], SFTModule, trainer_cfg) == []
    assert with_stability_csv([], [], CriticFreeModule, trainer_cfg) == []  # callbacks=none: no PNG to draw


@pytest.mark.slow
@pytest.mark.integration
def test_ppo_max_short_budget_with_wandb_alone_has_its_metric_and_stability_png(tmp_path, saved_models):
    """The README's PPO-max experiment on a short budget with ``logger=wandb`` (offline): the metric
    logged before the fit is measured again after it, and stability.png is drawn from the CSV log
    kept beside W&B."""
    cfg = compose(
        [
            "experiment=ppo_max_synthetic_tiny",
            f"algo.policy_path={saved_models[0]}",
            f"algo.reward_path={saved_models[1]}",
            "trainer.max_steps=4",
            "data.prompt.n_val=16",
            "logger=wandb",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics = run(cfg)
    assert math.isfinite(metric_value(metrics, "val/score_mean")) and "policy/loss" in metrics
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert (tmp_path / "csv" / "metrics.csv").is_file() and (tmp_path / "stability.png").stat().st_size > 20_000


@pytest.mark.slow
@pytest.mark.integration
def test_readme_tiny_experiments_sweep_on_a_short_budget_runs_every_job_and_prints_each_event_once(tmp_path):
    """``-m experiment=sft_synthetic_tiny,rm_synthetic_tiny trainer.max_steps=2``: both experiments
    name a val/ optimized_metric that a 2-step fit (of 4-step epochs) never logs; the sweep exits 0 and both jobs run
    and export, each in its own run directory with its own logger run (Hydra's basic launcher). The same
    output shows each Lightning line once, without ads or known warnings."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "experiment=sft_synthetic_tiny,rm_synthetic_tiny",
            "trainer.max_steps=2",
            "data.sft.n_train=256",
            "data.sft.n_val=64",
            "data.preference.n_train=256",
            "data.preference.n_val=64",
            "data.preference.n_test=64",
            "trainer.enable_progress_bar=false",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]
    assert (tmp_path / "0" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "1" / "reward_model" / "reward_config.json").is_file()
    columns = [(tmp_path / job / "csv" / "metrics.csv").read_text().splitlines()[0].split(",") for job in ("0", "1")]
    assert "val/perplexity" in columns[0] and "val/accuracy" not in columns[0]  # each job its own logger run
    assert "val/accuracy" in columns[1] and "val/perplexity" not in columns[1]
    console = out.stdout + out.stderr
    assert console.count("running a final validation") == 2 and "Configuration error" not in console
    assert console.count("Seed set to 42") == 2  # once per job (it was printed twice: "INFO: …" and Hydra's line)
    for noise in ("INFO: ", "💡", "Setting accelerator to CPU", "LeafSpec"):
        assert noise not in console, noise
