"""Gradient accumulation (``algo.micro_batch_size``) does not change the update: a minibatch of 8
cut into 2 micro-batches of 4 gives the gradient of one pass over the 8, for every aggregation and
for PPO's value and entropy terms, because every term divides by the whole minibatch's counts
(docs/algorithms.md §6). Naive accumulation (each micro-batch's own mean, halved) does not."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ppo
from tests.modules.test_grpo_module import Keep, data, fit, make


def _rollout_of_unequal_lengths(module, dm):
    """A real rollout of the module (one fitted iteration), its responses cut to lengths 1..R so the
    micro-batches hold very different token counts (what is cut is padding to the loss)."""
    keep = Keep()
    fit(module, dm, 1, callbacks=[keep])
    rollout = keep.outputs[0]["rollout"]
    n, width = rollout.response_mask.shape
    lengths = torch.tensor([1 + (7 * i) % width for i in range(n)])
    keep_tokens = (torch.arange(width)[None, :] < lengths[:, None]).to(rollout.response_mask.dtype)
    rollout.response_mask = rollout.response_mask * keep_tokens
    assert len(set(rollout.response_mask.sum(1).tolist())) > 2  # unequal token counts across rows
    return rollout


def _step_gradient(module, rollout, micro):
    """The gradient ``minibatch_step`` hands the optimizer, with ``algo.micro_batch_size=micro``."""
    grads = []
    module.config.micro_batch_size = micro
    module.manual_backward = lambda loss: loss.backward()
    module.optimizer_step = lambda opt, sched, finite: grads.append(
        [p.grad.clone() for p in module.parameters() if p.requires_grad]
    )
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)
    stats = module.minibatch_step(opt, None, rollout, None, None)
    return grads[0], stats


def _naive_gradient(module, rollout, micro):
    """What per-micro-batch code computes: each micro-batch's own mean, divided by their number."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    parts = torch.arange(rollout.scores.shape[0]).split(micro)
    for rows in parts:
        part = rollout.select(rows)
        loss, _ = module.minibatch_loss(part, module.policy_forward(part), None, module.loss_counts(part.valid_mask))
        (loss / len(parts)).backward()
    return [p.grad.clone() for p in params]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def _assert_differs(got, want):
    assert not all(torch.allclose(g, w, rtol=1e-3, atol=1e-6) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_two_micro_batches_of_4_are_one_batch_of_8_for_grpo(saved_models, tokenizer, aggregation):
    torch.manual_seed(0)
    m = make(
        saved_models,
        tokenizer,
        rollout_batch_size=8,
        loss_aggregation=aggregation,
        fuse_first_forward=False,
        kl_coef=0.05,
        generation={"max_new_tokens": 12},
    )
    rollout = _rollout_of_unequal_lengths(m, data(tokenizer, prompts=2))
    whole, whole_stats = _step_gradient(m, rollout, None)
    assert any(float(g.abs().max()) > 0 for g in whole)
    for micro in (4, 3):  # 2 x 4, and 3 + 3 + 2 (unequal micro-batches)
        split, split_stats = _step_gradient(m, rollout, micro)
        _assert_same(split, whole)
        # the logged loss of the minibatch is the sum of its micro-batches' shares
        for key in ("policy/loss", "policy/kl_loss"):
            assert float(split_stats[key]) == pytest.approx(float(whole_stats[key]), rel=1e-4, abs=1e-7), key
    # naive accumulation is wrong where the micro-batches' own counts differ: tokens for token_mean,
    # rows (3, 3, 2) for the per-response mean; Dr. GRPO divides by a constant, so it is exact there
    if aggregation == "token_mean":
        _assert_differs(_naive_gradient(m, rollout, 4), whole)
    elif aggregation == "seq_mean_token_mean":
        _assert_differs(_naive_gradient(m, rollout, 3), whole)


def test_two_micro_batches_of_4_are_one_batch_of_8_for_ppo_with_value_and_entropy(saved_models, tokenizer):
    torch.manual_seed(0)
    m = ppo.make(
        saved_models, tokenizer, minibatch_size=None, entropy_coef=0.01, fuse_first_forward=False, kl_coef=0.05
    )
    keep = Keep()
    ppo.fit(m, ppo.data(tokenizer), max_steps=1, callbacks=[keep])
    rollout = keep.outputs[0]["rollout"]
    n, width = rollout.response_mask.shape
    lengths = torch.tensor([1 + (3 * i) % width for i in range(n)])
    rollout.response_mask = rollout.response_mask * (torch.arange(width)[None, :] < lengths[:, None])
    whole, whole_stats = _step_gradient(m, rollout, None)
    split, split_stats = _step_gradient(m, rollout, 4)
    assert any(float(g.abs().max()) > 0 for g in whole)
    _assert_same(split, whole)  # actor and critic
    assert float(split_stats["critic/loss"]) == pytest.approx(float(whole_stats["critic/loss"]), rel=1e-4)
    _assert_differs(_naive_gradient(m, rollout, 4), whole)


def test_micro_batches_are_refused_where_they_cannot_be_exact(saved_models, tokenizer):
    from lit_rlhf.utils.config import ConfigError

    with pytest.raises(ConfigError, match="micro_batch_size") as err:
        ppo.make(saved_models, tokenizer, entropy_coef=0.01, entropy_target=1.0, micro_batch_size=2)
    assert "entropy_target" in str(err.value)
    m = make(saved_models, tokenizer, micro_batch_size=4)
    assert not m.fused_first_forward(16)  # a micro-batch forwards alone: the rollout's pass cannot be fused
    assert make(saved_models, tokenizer, micro_batch_size=16).fused_first_forward(16)
