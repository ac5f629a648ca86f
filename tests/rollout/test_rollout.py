import pytest
import torch

from lit_rlhf.data.collate import pad
from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.rollout.generate import GenerationConfig, response_mask_from_eos, sample
from lit_rlhf.rollout.minibatches import iterate_minibatches
from lit_rlhf.rollout.score import response_logprobs


def test_response_mask_ends_at_first_eos():
    ids = torch.tensor([[5, 3, 7, 3], [5, 6, 7, 8], [3, 9, 9, 9]])
    mask, ended = response_mask_from_eos(ids, eos_id=3)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]
    for row, m in zip(ids.tolist(), mask.tolist()):  # naive reference
        n = row.index(3) + 1 if 3 in row else len(row)
        assert m == [1] * n + [0] * (len(row) - n)


def test_minibatches_cover_every_index_once_per_epoch():
    g = torch.Generator().manual_seed(0)
    mbs = list(iterate_minibatches(10, 4, 2, g))
    assert [len(m) for m in mbs] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(mbs[:3]).tolist()) == list(range(10)) == sorted(torch.cat(mbs[3:]).tolist())


@pytest.fixture
def policy(tiny_spec, tokenizer):
    torch.manual_seed(0)
    return build_causal_lm(tiny_spec, tokenizer)


def test_left_padded_generation_matches_unpadded(policy, tokenizer):
    """Greedy responses of a left-padded batch equal each prompt generated alone (positions follow the mask)."""
    prompts = [[2, 10, 11, 12], [2, 20]]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False)
    ids, mask = pad(prompts, tokenizer.pad_token_id, "left")
    batch_resp, batch_mask, _ = sample(policy, ids, mask, gen, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        alone, alone_mask, _ = sample(policy, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), gen,
                                      tokenizer.eos_token_id, tokenizer.pad_token_id)  # fmt: skip
        n = int(alone_mask.sum())
        assert batch_resp[i, :n].tolist() == alone[0, :n].tolist()
    assert policy.training  # restored after generation


def test_sampling_settings_reach_generate(policy, tokenizer):
    ids = torch.tensor([[2, 10]])
    gen = GenerationConfig(max_new_tokens=5, temperature=0.7, top_p=0.5, top_k=3, repetition_penalty=1.3)
    torch.manual_seed(0)
    a = sample(policy, ids, torch.ones_like(ids), gen, tokenizer.eos_token_id, 0)[0]
    torch.manual_seed(0)
    b = sample(policy, ids, torch.ones_like(ids), gen, tokenizer.eos_token_id, 0)[0]
    assert a.tolist() == b.tolist() and a.shape[1] <= 5
    # top_k = 1 is greedy whatever the temperature
    greedy = sample(policy, ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=5, do_sample=False), tokenizer.eos_token_id, 0)[0]
    top1 = sample(policy, ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=5, top_k=1, temperature=2.0), tokenizer.eos_token_id, 0)[0]
    assert top1.tolist() == greedy.tolist()


def test_response_logprobs_match_naive_and_ignore_padding(policy):
    prompts, responses = [[2, 10, 11], [2, 12]], [[20, 21, 3], [22, 3]]
    p_ids, p_mask = pad(prompts, 0, "left")
    r_ids, r_mask = pad(responses, 0, "right")
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    with torch.no_grad():
        lp, ent = response_logprobs(policy, ids, mask, p_ids.shape[1], with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            full = torch.tensor([p + r])
            logp = policy(input_ids=full).logits[0].log_softmax(-1)
            for t, tok in enumerate(r):
                assert lp[i, t].item() == pytest.approx(logp[len(p) + t - 1, tok].item(), abs=1e-5)
                probs = logp[len(p) + t - 1].exp()
                assert ent[i, t].item() == pytest.approx(-(probs * logp[len(p) + t - 1]).sum().item(), abs=1e-4)


def test_greedy_matches_transformers_generate(policy, tokenizer):
    """The decoding loop equals model.generate token for token (greedy, with repetition penalty)."""
    prompts = [[2, 10, 11, 12], [2, 20], [2, 30, 31]]
    ids, mask = pad(prompts, tokenizer.pad_token_id, "left")
    for rep in (1.0, 1.3):
        gen = GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=rep)
        ours, ours_mask, _ = sample(policy, ids, mask, gen, eos_id=-1, pad_id=0)  # no EOS: full length
        with torch.no_grad():
            ref = policy.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                         repetition_penalty=rep, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]  # fmt: skip
        policy.train()
        assert ours.tolist() == ref.tolist(), rep


def test_process_logits_filters_like_transformers():
    """top-k, top-p and temperature against transformers' own warpers on random logits."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from lit_rlhf.rollout.generate import process_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 30, generator=g) * 3
    gen = GenerationConfig(temperature=0.7, top_k=10, top_p=0.8)
    ours = process_logits(logits, None, gen)
    ids = torch.zeros(5, 1, dtype=torch.long)
    ref = logits
    for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        ref = w(ids, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_sampling_distribution_follows_temperature(policy):
    """Empirical next-token frequencies match softmax(logits / T), and not softmax(logits)."""
    import copy

    peaky = copy.deepcopy(policy)
    with torch.no_grad():
        peaky.lm_head.weight.mul_(8.0)  # a few likely tokens: frequencies become precise at n = 4000
    ids = torch.tensor([[2, 10]])
    with torch.no_grad():
        logits = peaky(input_ids=ids).logits[0, -1]
    p_t, p_1 = (logits / 0.5).softmax(-1), logits.softmax(-1)
    torch.manual_seed(0)
    gen = GenerationConfig(max_new_tokens=1, temperature=0.5)
    draws = sample(peaky, ids.repeat(4000, 1), torch.ones(4000, 2, dtype=torch.long), gen, eos_id=-1, pad_id=0)[0][:, 0]
    freq = torch.bincount(draws, minlength=logits.numel()).float() / 4000
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()  # noqa: E731
    assert tv(p_t, p_1) > 0.1  # the two hypotheses are far apart
    assert tv(freq, p_t) < 0.03 and tv(freq, p_t) < tv(p_t, p_1) / 4
