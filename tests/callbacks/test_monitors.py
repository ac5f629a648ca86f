"""Monitors on hand-built rollouts: exact values, padding and truncation, docs/metrics.md names."""

import json
import math

import pytest
import torch

from lit_rlhf.callbacks import KLMonitor, PerplexityMonitor, ResponseLengthMonitor, RewardStatsMonitor
from lit_rlhf.core.types import Rollout

# docs/metrics.md: the canonical names the monitors own
METRIC_NAMES = {
    "stability/kl",
    "stability/kl_per_token",
    "stability/perplexity",
    "stability/perplexity_ref",
    "stability/response_length",
    "stability/response_length_max",
    "stability/truncation_rate",
    "reward/score_mean",
    "reward/score_std",
}


def rollout(logprobs, ref_logprobs, mask, ended, scores):
    mask = torch.tensor(mask)
    b, r = mask.shape
    return Rollout(
        prompt_ids=torch.zeros(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.zeros(b, r, dtype=torch.long),
        response_mask=mask,
        ended=torch.tensor(ended),
        logprobs=torch.tensor(logprobs),
        ref_logprobs=torch.tensor(ref_logprobs),
        values=torch.zeros(b, r),
        scores=torch.tensor(scores),
    )


# row 0: 2 tokens (EOS at 1), row 1: 4 tokens, truncated (no EOS); padded positions hold junk
R1 = rollout(
    logprobs=[[-1.0, -2.0, -99.0, -99.0], [-0.5, -0.5, -1.0, -1.0]],
    ref_logprobs=[[-1.5, -1.0, 50.0, 50.0], [-0.5, -1.5, -1.0, -2.0]],
    mask=[[1, 1, 0, 0], [1, 1, 1, 1]],
    ended=[True, False],
    scores=[1.0, 3.0],
)


def run(monitor, *rollouts):
    monitor.metrics = torch.nn.ModuleDict(monitor.build())
    for r in rollouts:
        monitor.update(r)
    return {k: v.item() for k, v in monitor.compute().items()}


def test_kl_monitor_exact():
    # k1 per token: row 0: [0.5, -1.0] -> Σ = -0.5; row 1: [0, 1, 0, 1] -> Σ = 2
    out = run(KLMonitor(), R1)
    assert out["stability/kl"] == pytest.approx((-0.5 + 2.0) / 2)
    assert out["stability/kl_per_token"] == pytest.approx(1.5 / 6)
    k3 = lambda d: math.exp(-d) + d - 1  # noqa: E731
    expected_k3 = (k3(0.5) + k3(-1.0) + k3(0.0) + k3(1.0) + k3(0.0) + k3(1.0)) / 2
    assert out["stability/kl_k3"] == pytest.approx(expected_k3, rel=1e-6)


def test_sequence_kl_and_moss_per_token_kl_differ_as_they_should():
    """Lengths 1 and 3, k1 = 1 on every token: sequence KL averages 2 nats per response, while the
    per-token mean (MOSS-RLHF's ref_kl) stays 1 whatever the lengths: it hides length growth."""
    r = rollout(
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[0.0] * 3, [0.0] * 3], [[1, 0, 0], [1, 1, 1]], [True, True], [0.0, 0.0]
    )
    out = run(KLMonitor(), r)
    assert out["stability/kl"] == pytest.approx(2.0) and out["stability/kl_per_token"] == pytest.approx(1.0)


def test_perplexity_exact_over_response_tokens_only():
    out = run(PerplexityMonitor(), R1)
    assert out["stability/perplexity"] == pytest.approx(math.exp((1 + 2 + 0.5 + 0.5 + 1 + 1) / 6))
    assert out["stability/perplexity_ref"] == pytest.approx(math.exp((1.5 + 1 + 0.5 + 1.5 + 1 + 2) / 6))


def test_length_and_truncation():
    out = run(ResponseLengthMonitor(), R1)
    assert out == {
        "stability/response_length": 3.0,
        "stability/response_length_max": 4.0,
        "stability/truncation_rate": 0.5,
    }


def test_aggregation_over_iterations_sums_not_means():
    """Two iterations aggregated: per-token KL is Σ/Σ over both, not the mean of two means."""
    r2 = rollout([[0.0, 0.0]], [[-3.0, 0.0]], [[1, 0]], [True], [5.0])  # one token, k1 = 3
    out = run(KLMonitor(), R1, r2)
    assert out["stability/kl_per_token"] == pytest.approx((1.5 + 3.0) / 7)
    assert out["stability/kl"] == pytest.approx((1.5 + 3.0) / 3)
    out = run(ResponseLengthMonitor(), R1, r2)
    assert out["stability/response_length"] == pytest.approx(7 / 3) and out[
        "stability/truncation_rate"
    ] == pytest.approx(1 / 3)


def test_reward_stats():
    scores = [float(x) for x in range(21)]  # 0..20
    r = rollout([[0.0]] * 21, [[0.0]] * 21, [[1]] * 21, [True] * 21, scores)
    out = run(RewardStatsMonitor(), r)
    t = torch.tensor(scores)
    assert out["reward/score_mean"] == 10.0 and out["reward/score_std"] == pytest.approx(t.std(unbiased=False).item())
    assert (out["reward/score_q05"], out["reward/score_q50"], out["reward/score_q95"]) == pytest.approx(
        (1.0, 10.0, 19.0)
    )
    assert out["reward/tail_ratio"] == pytest.approx((19 - 10) / (10 - 1))


def test_names_match_design():
    names = set()
    for m in (KLMonitor(), PerplexityMonitor(), ResponseLengthMonitor(), RewardStatsMonitor()):
        names |= set(run(m, R1))
    assert names >= METRIC_NAMES
    assert all(n.split("/")[0] in ("stability", "reward") for n in names)


def test_monitors_in_a_ppo_fit(tmp_path, tokenizer, saved_models):
    """Through Lightning: the rollout in training_step's outputs reaches the callbacks, the values
    land in the logs, the progress bar shows the RL step, reward, KL and length, and the files
    (reward_scores.jsonl, samples.jsonl, stability.png) are written."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lit_rlhf.callbacks import SamplesTable, StabilityReport
    from tests.helpers.ppo import data, make

    module = make(saved_models, tokenizer, kl_coef=0.05)
    callbacks = [
        KLMonitor(),
        PerplexityMonitor(),
        ResponseLengthMonitor(),
        RewardStatsMonitor(),
        SamplesTable(every_n_steps=2, max_rows=3),
        StabilityReport(),
    ]
    trainer = pl.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data(tokenizer))
    assert set(trainer.callback_metrics) >= METRIC_NAMES
    assert {"rl/iteration", "reward/score_mean", "stability/kl", "stability/response_length"} <= set(
        trainer.progress_bar_metrics
    )
    lines = [json.loads(x) for x in (tmp_path / "reward_scores.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(len(x["scores"]) == 8 for x in lines)  # 4 iterations x 8 rollouts
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and set(samples[0]) == {"step", "prompt", "response", "score", "kl", "length"}
    assert (tmp_path / "stability.png").stat().st_size > 20_000
