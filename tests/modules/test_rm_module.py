import math

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.data.preference import PreferenceDataModule
from lit_rlhf.models.reward import load_reward_model
from lit_rlhf.modules.reward_model import RewardModelModule, wilson_interval
from lit_rlhf.utils.config import ConfigError


def small_data(tokenizer, **kw):
    dm = PreferenceDataModule(n_train=64, n_val=24, n_test=24, batch_size=8, **kw).connect(tokenizer)
    dm.setup("fit")
    return dm


def module(tiny_spec, tokenizer, **kw):
    m = RewardModelModule(model=tiny_spec, tokenizer=tokenizer, **kw)
    m.configure_model()
    return m


def test_wilson_interval_hand_values():
    low, high = wilson_interval(50, 100)
    assert (low, high) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    low, high = wilson_interval(200, 312)
    assert low < 200 / 312 < high and high - low == pytest.approx(0.1052, abs=1e-3)


def test_lm_term_adds_beta_times_chosen_nll(tiny_spec, tokenizer):
    torch.manual_seed(0)
    m = module(tiny_spec, tokenizer, beta_rm=0.5)
    batch = next(iter(small_data(tokenizer)._loader("train", train=False)))
    chosen, rejected, hidden = m._scores(batch)
    lm = m.lm_loss(batch, hidden)
    # naive: the chosen rows through the full causal LM, mean NLL over their response tokens
    b = batch["input_ids"].shape[0] // 2
    nll, n = 0.0, 0
    for i in range(b):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        lp = m.reward_model.backbone(input_ids=ids).logits[0].log_softmax(-1)
        for t in torch.nonzero(batch["response_mask"][i][keep]).flatten().tolist():
            nll -= lp[t - 1, ids[0, t]].item()
            n += 1
    assert lm.item() == pytest.approx(nll / n, rel=1e-4)
    # and the scores are the last real token's (EOS) head output
    last = batch["attention_mask"].sum(1) - 1
    h = hidden[torch.arange(2 * b), last]
    torch.testing.assert_close(torch.cat([chosen, rejected]), m.reward_model.head(h))


def test_few_steps_change_every_parameter_and_metrics_aggregate(tiny_spec, tokenizer, tmp_path):
    torch.manual_seed(0)
    # center_coef > 0: under Bradley–Terry alone the head's bias cancels in r_w − r_l (zero gradient)
    m = module(tiny_spec, tokenizer, lr=1e-2, beta_rm=1.0, center_coef=0.01, export_dir=str(tmp_path / "rm"))
    before = {k: v.detach().clone() for k, v in m.reward_model.named_parameters()}
    dm = small_data(tokenizer)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(m, dm)
    for name, p in m.reward_model.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"
    # val/accuracy is over all 24 pairs (3 batches), recomputed here independently
    m.eval()
    correct = 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            c, r, _ = m._scores(batch)
            correct += (c > r).sum().item()
    assert trainer.callback_metrics["val/accuracy"].item() == pytest.approx(correct / 24)
    assert trainer.callback_metrics["val/gold_accuracy"].item() == pytest.approx(dm.gold_accuracy["val"])
    for key in ("rm/accuracy", "rm/margin", "rm/score_mean", "rm/score_std", "rm/lm_loss", "train/loss"):
        assert math.isfinite(trainer.callback_metrics[key].item())
    # test loop: accuracy with its Wilson interval
    trainer.test(m, dm)
    acc = trainer.callback_metrics["test/accuracy"].item()
    low, high = (
        trainer.callback_metrics["test/accuracy_ci_low"].item(),
        trainer.callback_metrics["test/accuracy_ci_high"].item(),
    )
    assert (low, high) == pytest.approx(wilson_interval(round(acc * 24), 24))
    # export -> reload gives identical scores
    again = load_reward_model(str(tmp_path / "rm")).eval()
    batch = next(iter(dm.val_dataloader()))
    torch.testing.assert_close(
        again(batch["input_ids"], batch["attention_mask"]), m(batch["input_ids"], batch["attention_mask"])
    )


def test_lm_term_needs_a_causal_backbone(tmp_path):
    from lit_rlhf.launch.runner import plan
    from tests.conftest import compose

    with pytest.raises(
        ConfigError, match=r"algo\.beta_rm: the LM term needs a causal LM backbone; model\.kind=encoder"
    ):
        plan(compose(["model=minilm_rm", "algo=rm", "algo.beta_rm=1.0"], tmp_path))


@pytest.mark.slow
def test_tiny_rm_reaches_90_percent_of_the_gold_ceiling(tmp_path):
    """On held-out embedded pairs, the tiny RM's accuracy ≥ 0.9 × the gold reward's own accuracy."""
    from lit_rlhf.launch.runner import run
    from tests.conftest import compose

    cfg = compose(
        [
            "experiment=rm_synthetic_tiny",
            "trainer.accelerator=cpu",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "data.preference.n_train=6000",
            "data.preference.n_test=1000",
            "data.batch_size=32",
        ],
        tmp_path,
    )
    metrics = run(cfg)
    assert metrics["test/accuracy"] >= 0.9 * metrics["test/gold_accuracy"], metrics
    assert (tmp_path / "reward_model" / "reward_config.json").exists()


@pytest.mark.slow
def test_wandb_receives_metrics_and_score_histograms(tiny_spec, tokenizer, tmp_path):
    """Offline W&B (wandb 0.31 writes no summary file offline: read the in-process summary)."""
    import wandb

    from lit_rlhf.utils.loggers import wandb_logger

    logger = wandb_logger(save_dir=str(tmp_path), offline=True, project="lit_rlhf_test")
    try:
        m = module(tiny_spec, tokenizer)
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=False,
            log_every_n_steps=1,
        )
        trainer.fit(m, small_data(tokenizer))
        summary = dict(logger.experiment.summary)
        assert {"val/accuracy", "val/margin", "val/score_mean", "val/score_std", "rm/accuracy"} <= set(summary)
        for key in ("val/score_chosen_hist", "val/score_rejected_hist"):
            assert summary[key]["_type"] == "histogram"
    finally:
        wandb.finish()


def test_export_writes_the_best_checkpoint_not_the_last(tiny_spec, tokenizer, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    m = RewardModelModule(model=tiny_spec, tokenizer=tokenizer, lr=3e-3, export_dir=str(tmp_path / "rm"))
    # mode "min": the WORST epoch is "best", so the best checkpoint is surely not the last weights
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/accuracy", mode="min", save_top_k=1)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=[ckpt],
        num_sanity_val_steps=0,
    )
    trainer.fit(m, small_data(tokenizer))
    best = torch.load(ckpt.best_model_path, weights_only=False)["state_dict"]
    live = m.reward_model.state_dict()
    exported = load_reward_model(str(tmp_path / "rm")).state_dict()
    assert exported.keys() == live.keys()
    assert any(not torch.equal(best[f"reward_model.{k}"], live[k]) for k in live)  # best is not the last
    for k, v in exported.items():
        torch.testing.assert_close(v, best[f"reward_model.{k}"], rtol=0, atol=0, msg=k)


def test_best_checkpoint_missing_weights_is_refused_by_name(tiny_spec, tokenizer, tmp_path):
    m = module(tiny_spec, tokenizer)
    path = tmp_path / "partial.ckpt"
    torch.save({"state_dict": {k: v for k, v in m.state_dict().items() if "head" not in k}}, path)
    with pytest.raises(KeyError, match="partial.ckpt lacks .* reward-model weights"):
        m.best_state_dict(str(path))


def test_training_rm_metrics_aggregate_over_the_logging_window(tiny_spec, tokenizer):
    """rm/accuracy, rm/margin, rm/score_mean, rm/score_std cover every batch of the last
    log_every_n_steps window (torchmetrics), not just the last batch."""
    torch.manual_seed(0)
    m = module(tiny_spec, tokenizer, lr=1e-2)
    seen, real = [], m._scores

    def spy(batch):
        c, r, h = real(batch)
        seen.append((c.detach(), r.detach()))
        return c, r, h

    m._scores = spy
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=3,
        limit_val_batches=0,
    )
    trainer.fit(m, small_data(tokenizer))
    n = len(seen)
    assert n == 8  # 64 pairs / 8: windows [0-2], [3-5], [6-7] (the epoch's last batch closes one)
    c = torch.cat([x[0] for x in seen[6:]])
    r = torch.cat([x[1] for x in seen[6:]])
    both = torch.cat([c, r])
    got = {k: trainer.callback_metrics[f"rm/{k}"].item() for k in ("accuracy", "margin", "score_mean", "score_std")}
    assert got["accuracy"] == pytest.approx((c > r).float().mean().item())
    assert got["margin"] == pytest.approx((c - r).mean().item(), abs=1e-6)
    assert got["score_mean"] == pytest.approx(both.mean().item(), abs=1e-6)
    assert got["score_std"] == pytest.approx(both.std(unbiased=False).item(), rel=1e-4)
    assert got["margin"] != pytest.approx(
        (seen[-1][0] - seen[-1][1]).mean().item(), abs=1e-6
    )  # not the last batch alone
