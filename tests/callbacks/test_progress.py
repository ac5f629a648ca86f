"""RLProgressBar: RL stages count iterations against the step budget, not epochs and batches."""

import lightning.pytorch as pl

from lit_rlhf.callbacks.progress import RLProgressBar
from tests.helpers.ppo import data, make


def test_rl_bar_counts_iterations_and_optimizer_steps(saved_models, tokenizer, tmp_path):
    bar = RLProgressBar()
    m = make(saved_models, tokenizer, minibatch_size=2)  # 8 rollouts / 2 = 4 optimizer steps per iteration
    trainer = pl.Trainer(
        max_steps=6,
        max_epochs=-1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[bar],
        default_root_dir=tmp_path,
    )
    trainer.fit(m, data(tokenizer))
    assert trainer.global_step == 6 and m.rl_iteration == 2
    assert bar.train_progress_bar.total == 2  # ceil(6 steps / 4 per iteration), not Lightning's 6 "batches"
    assert bar.train_progress_bar.desc.startswith("RL iterations")
    metrics = bar.get_metrics(trainer, m)
    assert metrics["opt_steps"] == "6/6" and "v_num" not in metrics


def test_other_stages_keep_the_stock_bar(tmp_path):
    from lit_rlhf.launch.runner import build
    from tests.conftest import CPU_FAST, compose

    _, dm, module = build(compose([*CPU_FAST, "trainer.max_steps=3"], tmp_path))
    bar = RLProgressBar()
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[bar],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    assert bar.train_progress_bar.desc.startswith("Epoch") and "opt_steps" not in bar.get_metrics(trainer, module)
