"""Non-finite rewards, losses and gradients never reach the weights (lit_rlhf/modules/health.py)."""

import json

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.modules.health import NonFiniteTrainingError
from tests.helpers.ppo import data, fit, make

NAN_FN = {"_target_": "tests.modules.test_health.nan_from_call", "start": 3}


def nan_from_call(start):
    """Gold-like rewards; from the ``start``-th call on, NaN for every 4th sample (the issue's reproduction)."""
    calls = {"n": 0}

    def fn(prompts, responses, ended):
        calls["n"] += 1
        values = [float(len(r.split())) / 10 for r in responses]
        if calls["n"] >= start:
            for i in range(0, len(values), 4):
                values[i] = float("nan")
        return values

    return fn


def test_non_finite_rewards_are_skipped_counted_and_stop_the_run_after_k_iterations(saved_models, tokenizer, tmp_path):
    from lit_rlhf.callbacks import RewardStatsMonitor

    m = make(saved_models, tokenizer, reward_fn=NAN_FN, score_norm="normalize", max_bad_iterations=3, minibatch_size=8)
    seen = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, out, batch, batch_idx):
            seen.append(
                (
                    float(trainer.callback_metrics["health/nonfinite_scores"]),
                    [p.detach().clone() for p in module.actor.parameters()],
                )
            )

    with pytest.raises(
        NonFiniteTrainingError,
        match=r"reward_fn tests.modules.test_health.nan_from_call returned NaN or inf "
        r"for 2 of 8 samples in 3 consecutive iterations",
    ):
        fit(m, data(tokenizer), max_steps=20, callbacks=[Keep(), RewardStatsMonitor()], default_root_dir=tmp_path)
    assert [n for n, _ in seen] == [0.0, 0.0, 2.0, 2.0]  # the 5th iteration raised before the callbacks
    assert all(torch.isfinite(p).all() for _, params in seen for p in params)
    assert any(not torch.equal(a, b) for a, b in zip(seen[2][1], seen[3][1]))  # the finite samples still trained
    moments = m.reward_moments.state_dict()
    assert all(v == v and abs(v) != float("inf") for v in moments.values()) and moments["count"] == 8 + 8 + 6 + 6 + 6
    rows = [json.loads(line) for line in (tmp_path / "reward_scores.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in rows] == [0, 0, 2, 2] and all(len(r["scores"]) == 8 - r["nonfinite"] for r in rows)


def test_a_non_finite_loss_is_skipped_without_touching_the_weights(saved_models, tokenizer, monkeypatch):
    m = make(saved_models, tokenizer, minibatch_size=8)
    m.configure_model()
    before = [p.detach().clone() for p in m.parameters()]
    real = m.minibatch_loss
    monkeypatch.setattr(m, "minibatch_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    trainer = fit(m, data(tokenizer), max_steps=1, max_epochs=1, limit_train_batches=2)
    assert trainer.global_step == 0 and float(trainer.callback_metrics["health/skipped_updates"]) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_nothing_is_exported_with_non_finite_weights(saved_models, tokenizer, tmp_path):
    m = make(saved_models, tokenizer)
    m.configure_model()
    with torch.no_grad():
        next(m.actor.parameters())[0, 0] = float("nan")
    with pytest.raises(
        NonFiniteTrainingError,
        match=r"refusing to write the model to .*actor: \d+ tensors hold NaN/inf \(e.g. \[.model.embed_tokens.weight.",
    ):
        m.export(str(tmp_path / "actor"))
    assert not (tmp_path / "actor").exists()
