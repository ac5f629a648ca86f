"""Padding-free sequence log-probs of a real (tiny) Llama: equal to each sequence scored alone,
with equal gradients; a model whose attention mixes packed sequences is caught and falls back."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_rlhf.core.logprobs import sequence_logprobs
from lit_rlhf.models.packed import PaddingFree


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64, attn_implementation=attn)  # fmt: skip
    return LlamaForCausalLM(cfg)


def batch():
    """Right-padded rows of very different lengths; response = the last ``resp`` real tokens."""
    g = torch.Generator().manual_seed(1)
    lengths, resp = [9, 3, 14, 6, 2, 11], [4, 1, 7, 3, 1, 5]
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask, rmask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (n, r) in enumerate(zip(lengths, resp)):
        ids[b, :n] = torch.randint(1, 50, (n,), generator=g)
        mask[b, :n] = 1
        rmask[b, n - r : n] = 1
    return ids, mask, rmask


def alone(model, ids, mask, rmask):
    """Each row scored by its own unpadded forward: the independent reference."""
    out = []
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        logits = model(input_ids=ids[b : b + 1, :n]).logits.log_softmax(-1)[0]
        out.append(sum(logits[t - 1, ids[b, t]] for t in range(n) if rmask[b, t]))
    return torch.stack(out)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_each_sequence_alone_and_gradients_match(attn):
    model = tiny_llama(attn)
    ids, mask, rmask = batch()
    pf = PaddingFree(enabled=True)
    got = pf.sequence_logprobs(model, ids, mask, rmask)
    assert pf.uses_packing(model) is True
    want = alone(model, ids, mask, rmask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)
    model.zero_grad()
    padded = sequence_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, rmask)
    ref = torch.autograd.grad(padded.sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class IgnoresPositions(torch.nn.Module):
    """A causal LM that numbers positions itself (0..C-1 per row): packed sequences see each other."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_a_model_that_mixes_packed_sequences_is_caught_and_scored_padded(caplog):
    model = IgnoresPositions(tiny_llama("sdpa")).train()
    ids, mask, rmask = batch()
    pf = PaddingFree(enabled=True)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.models.packed"):
        got = pf.sequence_logprobs(model, ids, mask, rmask)
    assert pf.uses_packing(model) is False
    assert "using padded forwards" in caplog.text
    assert model.training  # the check ran in eval mode and put the mode back
    torch.testing.assert_close(got, alone(model.model, ids, mask, rmask), atol=1e-5, rtol=0)


def test_disabled_never_packs():
    model = tiny_llama("sdpa")
    ids, mask, rmask = batch()
    pf = PaddingFree(enabled=False)
    got = pf.sequence_logprobs(model, ids, mask, rmask)
    assert pf.uses_packing(model) is False and not pf.verdicts
    torch.testing.assert_close(got, alone(model, ids, mask, rmask), atol=1e-5, rtol=0)
