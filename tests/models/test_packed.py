"""Padding-free sequence log-probs of a real (tiny) Llama: equal to each sequence scored alone,
with equal gradients; a model whose attention mixes packed sequences is caught and falls back."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_rlhf.core.logprobs import sequence_logprobs as padded_sequence_logprobs
from lit_rlhf.models.packed import packed_logits, packing_verdict, sequence_logprobs


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
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
    got = sequence_logprobs(model, ids, mask, rmask)
    assert packing_verdict(model) is True
    want = alone(model, ids, mask, rmask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)
    model.zero_grad()
    padded = padded_sequence_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, rmask)
    ref = torch.autograd.grad(padded.sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class IgnoresPositions(torch.nn.Module):
    """A decoder that numbers positions itself (0..C-1 per row): packed sequences see each other."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, position_ids=None, **kw):
        return self.decoder(input_ids=input_ids, **kw)


def test_a_model_that_mixes_packed_sequences_is_caught_and_scored_padded(caplog):
    model = tiny_llama("sdpa").train()
    broken = IgnoresPositions(model.model)
    model.get_decoder = lambda: broken
    ids, mask, rmask = batch()
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.models.packed"):
        got = sequence_logprobs(model, ids, mask, rmask)
    assert packing_verdict(model) is False
    assert "using padded forwards" in caplog.text
    assert model.training  # the check ran in eval mode and put the mode back
    torch.testing.assert_close(got, alone(model, ids, mask, rmask), atol=1e-5, rtol=0)


def test_logits_beyond_the_lm_head_are_caught():
    """Scaled logits (Cohere's logit_scale) are not lm_head(decoder(x)): packing must not be used."""
    model = tiny_llama("sdpa")
    forward = model.forward
    model.forward = lambda *a, **k: type(forward(*a, **k))(logits=4.0 * forward(*a, **k).logits)
    ids, mask, rmask = batch()
    sequence_logprobs(model, ids, mask, rmask)
    assert packing_verdict(model) is False


def test_disabled_never_packs():
    model = tiny_llama("sdpa")
    ids, mask, rmask = batch()
    got = sequence_logprobs(model, ids, mask, rmask, padding_free=False)
    assert packing_verdict(model) is None
    torch.testing.assert_close(got, alone(model, ids, mask, rmask), atol=1e-5, rtol=0)


def test_the_lm_head_runs_only_at_the_positions_asked_for():
    model = tiny_llama("sdpa")
    rows = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].reshape(-1, 32).shape[0]))
    ids, mask, rmask = batch()
    positions = torch.tensor([0, 1, 15, 30])
    with torch.no_grad():
        got = packed_logits(model, ids, mask, positions)
        want = model(input_ids=ids, attention_mask=mask).logits.reshape(-1, 50)[positions]
    assert rows == [4, ids.numel()]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reward_model_and_critic_score_the_same_packed():
    """A causal reward model's scores and a critic's values at real tokens, and their gradients,
    are the padded forward's; an encoder reward model is never packed."""
    from lit_rlhf.models.reward import RewardModel
    from lit_rlhf.models.value import ValueModel

    ids, mask, _ = batch()
    rm = RewardModel(tiny_llama("sdpa"), "causal_lm", "last")
    critic = ValueModel(tiny_llama("eager"))
    out = {}
    for padding_free in (False, True):
        rm.padding_free = critic.padding_free = padding_free
        scores, values = rm(ids, mask), critic(ids, mask)
        loss = scores.sum() + (values * mask).sum()
        params = [p for p in list(rm.parameters()) + list(critic.parameters()) if p.requires_grad]
        out[padding_free] = (scores, values[mask.bool()], torch.autograd.grad(loss, params, allow_unused=True))
    assert packing_verdict(rm.trunk) is True and packing_verdict(critic.backbone.base_model) is True
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    for a, b in zip(out[True][2], out[False][2]):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    from transformers import BertConfig, BertModel

    encoder = RewardModel(
        BertModel(
            BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
        ),
        "encoder",
        "mean",
    )
    encoder.padding_free = True
    assert encoder(ids, mask).shape == (ids.shape[0],) and packing_verdict(encoder.trunk) is None
