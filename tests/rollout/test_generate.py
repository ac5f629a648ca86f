"""The hf engine's decoding loop (lit_rlhf/rollout/generate.py, kv_cache.py): stop ids, padding,
sampling settings against transformers' generate, the preallocated KV cache and the prebuilt masks."""

import pytest
import torch

from lit_rlhf.data.collate import pad
from lit_rlhf.rollout.generate import GenerationConfig, response_mask_from_eos, sample


def test_response_mask_ends_at_first_eos():
    ids = torch.tensor([[5, 3, 7, 3], [5, 6, 7, 8], [3, 9, 9, 9]])
    mask, ended = response_mask_from_eos(ids, eos_id=3)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]
    for row, m in zip(ids.tolist(), mask.tolist()):  # naive reference
        n = row.index(3) + 1 if 3 in row else len(row)
        assert m == [1] * n + [0] * (len(row) - n)


def test_response_mask_ends_at_the_first_of_several_stop_ids():
    ids = torch.tensor([[5, 4, 7, 3], [5, 6, 7, 8], [3, 9, 4, 9]])
    mask, ended = response_mask_from_eos(ids, eos_id=[3, 4])  # EOS 3 and an end-of-turn token 4
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]


def test_sampling_stops_at_any_stop_id(policy, tokenizer):
    """With EOS and another id as stops, greedy decoding ends at the first occurrence of either:
    the same tokens as without the extra stop up to there, then padding."""
    prompts = [[2, 10, 11, 12], [2, 20]]
    ids, mask = pad(prompts, tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=10, do_sample=False)
    free, _, _, _ = sample(policy, ids, mask, gen, -1, tokenizer.pad_token_id)  # no stop: full length
    stop_tok = free[0, 2].item()  # the first row's third token becomes an end-of-turn id
    resp, resp_mask, ended, _ = sample(
        policy, ids, mask, gen, [tokenizer.eos_token_id, stop_tok], tokenizer.pad_token_id
    )
    for row in range(2):
        toks = free[row].tolist()
        n = toks.index(stop_tok) + 1 if stop_tok in toks else len(toks)
        assert resp_mask[row].tolist()[:n] == [1] * n and not any(resp_mask[row].tolist()[n:])
        assert resp[row, :n].tolist() == toks[:n] and bool(ended[row]) == (stop_tok in toks)
    assert ended[0] and int(resp_mask[0].sum()) <= 3


def test_left_padded_generation_matches_unpadded(policy, tokenizer):
    """Greedy responses of a left-padded batch equal each prompt generated alone (positions follow the mask)."""
    prompts = [[2, 10, 11, 12], [2, 20]]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False)
    ids, mask = pad(prompts, tokenizer.pad_token_id, "left")
    batch_resp, batch_mask, _, _ = sample(policy, ids, mask, gen, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        alone, alone_mask, _, _ = sample(
            policy,
            torch.tensor([p]),
            torch.ones(1, len(p), dtype=torch.long),
            gen,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
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
    greedy = sample(
        policy,
        ids,
        torch.ones_like(ids),
        GenerationConfig(max_new_tokens=5, do_sample=False),
        tokenizer.eos_token_id,
        0,
    )[0]
    top1 = sample(
        policy,
        ids,
        torch.ones_like(ids),
        GenerationConfig(max_new_tokens=5, top_k=1, temperature=2.0),
        tokenizer.eos_token_id,
        0,
    )[0]
    assert top1.tolist() == greedy.tolist()


def test_greedy_matches_transformers_generate(policy, tokenizer):
    """The decoding loop equals model.generate token for token (greedy, with repetition penalty)."""
    prompts = [[2, 10, 11, 12], [2, 20], [2, 30, 31]]
    ids, mask = pad(prompts, tokenizer.pad_token_id, "left")
    for rep in (1.0, 1.3):
        gen = GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=rep)
        ours, ours_mask, _, _ = sample(policy, ids, mask, gen, eos_id=-1, pad_id=0)  # no EOS: full length
        with torch.no_grad():
            ref = policy.eval().generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=10,
                do_sample=False,
                repetition_penalty=rep,
                pad_token_id=0,
                eos_token_id=None,
            )[:, ids.shape[1] :]
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


def test_preallocated_cache_samples_exactly_as_the_growing_cache(policy, tokenizer, monkeypatch):
    """Same seed, same tokens with the KV cache written in place as with transformers' DynamicCache
    (which concatenates at every step); the buffers hold prompt + max_new_tokens positions."""
    from transformers import DynamicCache

    import lit_rlhf.rollout.kv_cache as kv_cache

    ids, mask = pad([[2, 10, 11, 12], [2, 20], [2, 30, 31]], tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    built = []
    real = kv_cache.preallocated_cache
    monkeypatch.setattr(kv_cache, "preallocated_cache", lambda m, cap: built.append(real(m, cap)) or built[-1])
    torch.manual_seed(3)
    ours = sample(policy, ids, mask, gen, eos_id=-1, pad_id=0)[0]
    layer = built[0].layers[0]
    assert type(layer).__name__ == "PreallocatedLayer" and layer._k.shape[2] == ids.shape[1] + 12
    assert layer.get_seq_length() == ids.shape[1] + 11  # the last sampled token is never fed back
    monkeypatch.setattr(kv_cache, "preallocated_cache", lambda m, cap: DynamicCache(config=m.config))
    torch.manual_seed(3)
    growing = sample(policy, ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert ours.tolist() == growing.tolist()


def test_preallocated_cache_refuses_overflow_and_sliding_window_models_keep_transformers_caches_and_masks():
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.cache_utils import DynamicLayer

    from lit_rlhf.rollout.generate import _decode_mask_table
    from lit_rlhf.rollout.kv_cache import preallocated_cache

    cfg = MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    cache = preallocated_cache(MistralForCausalLM(cfg), 5)
    assert all(
        type(layer).__name__ != "PreallocatedLayer" and isinstance(layer, DynamicLayer) for layer in cache.layers
    )
    assert _decode_mask_table(MistralForCausalLM(cfg), torch.ones(1, 3), 5) is None
    cfg.sliding_window = None
    assert _decode_mask_table(MistralForCausalLM(cfg), torch.ones(1, 3), 5) is not None
    cache = preallocated_cache(MistralForCausalLM(cfg), 5)
    layer = cache.layers[0]
    assert type(layer).__name__ == "PreallocatedLayer"
    k = torch.randn(1, 1, 3, 8)
    keys, values = layer.update(k, k + 1)
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    keys, _ = layer.update(k[:, :, :2], k[:, :, :2])
    assert torch.equal(keys, torch.cat([k, k[:, :, :2]], 2))
    with pytest.raises(RuntimeError, match="capacity 5 exceeded"):
        layer.update(k[:, :, :1], k[:, :, :1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prebuilt_decode_masks_sample_exactly_as_transformers_masks(attn, tokenizer, monkeypatch):
    """The decoding forwards' 4-D masks built once, with the layer-level decoding step they enable,
    give the same tokens (same seed, left-padded prompts, sampling) as the model's own forward
    with transformers' masks rebuilt from the 2-D mask at every step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.generate as generate

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg)
    ids, mask = pad([[2, 10, 11, 12, 13], [2, 20], [2, 30, 31]], tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=16, temperature=1.5)
    table = generate._decode_mask_table(model, mask, 16)
    assert table.shape == (3, 1, 1, 5 + 16)
    if attn == "sdpa":
        assert table.dtype == torch.bool and table[1, 0, 0].tolist() == [False] * 3 + [True] * 18
    else:
        assert table.dtype == torch.float32 and table[1, 0, 0, 0] == torch.finfo(torch.float32).min
        assert bool((table[1, 0, 0, 3:] == 0).all())
    torch.manual_seed(5)
    prebuilt = sample(model, ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert generate.layer_step_verdict(model, prepacked=True) is True  # decoded through its (prepacked) layers
    monkeypatch.setattr(generate, "_decode_mask_table", lambda *a: None)
    torch.manual_seed(5)
    rebuilt = sample(model, ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert prebuilt.tolist() == rebuilt.tolist()


def test_draw_is_multinomial_draw_for_draw():
    """``draw`` picks exactly the token ``torch.multinomial(probs, 1)`` picks from the same
    generator state, including rows with filtered (zero-probability) tokens, and leaves the
    generator where multinomial leaves it."""
    from lit_rlhf.rollout.generate import draw

    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        logits = torch.randn(8, 37, generator=gen) * (1 + trial % 5)
        logits[:, : trial % 7] = float("-inf")  # top-k/top-p filtering leaves zeros
        probs = logits.softmax(-1)
        torch.manual_seed(trial)
        expected = torch.multinomial(probs, 1).squeeze(-1)
        after_multinomial = torch.rand(3)
        torch.manual_seed(trial)
        got = draw(probs)
        assert torch.equal(got, expected)
        assert torch.equal(torch.rand(3), after_multinomial)
        assert not bool((probs.gather(1, got[:, None]) == 0).any())


def test_nonfinite_probabilities_stop_sampling_with_a_clear_error(policy, tokenizer):
    """A policy whose logits are NaN stops the rollout with an error saying so (torch.multinomial
    used to raise at the first such step; the loop checks once per rollout instead)."""
    import copy

    broken = copy.deepcopy(policy)
    with torch.no_grad():
        broken.lm_head.weight[3].fill_(float("nan"))
    ids, mask = pad([[2, 10, 11], [2, 20]], tokenizer.pad_token_id, "left")
    with pytest.raises(RuntimeError, match="probabilities are not finite"):
        sample(broken, ids, mask, GenerationConfig(max_new_tokens=4), eos_id=-1, pad_id=0)


def test_decoding_stops_where_the_models_positions_end(caplog):
    """A GPT-2 (learned positions: an index error past them) of 16 positions, prompts of up to 10
    tokens and 12 new tokens asked: 6 are decoded, as vLLM would cut at its max_model_len, warned once
    naming the keys; the tokens are greedy decoding's own (transformers' generate with the same cap);
    a prompt that fills every position is an error naming the prompt length's key."""
    import logging

    import transformers as tf

    from lit_rlhf.utils.config import ConfigError

    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=16, vocab_size=40, initializer_range=0.5)
    model = tf.GPT2LMHeadModel(config).eval()
    prompt_ids, prompt_mask = pad([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10]], 0, "left")
    gen = GenerationConfig(max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.rollout.generate"):
        ids, mask, ended, _ = sample(model, prompt_ids, prompt_mask, gen, eos_id=39, pad_id=0)
        sample(model, prompt_ids, prompt_mask, gen, eos_id=39, pad_id=0)
    assert ids.shape == (2, 6) and not ended.any()
    cut = [r.getMessage() for r in caplog.records if "responses are cut" in r.getMessage()]
    assert len(cut) == 1 and "GPT2LMHeadModel's 16 positions" in cut[0] and "max_new_tokens=12" in cut[0]
    with torch.no_grad():
        want = model.generate(
            input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]), max_new_tokens=6, do_sample=False
        )
    assert ids[0].tolist() == want[0, 10:].tolist()
    full, full_mask = pad([list(range(1, 17))], 0, "left")
    with pytest.raises(ConfigError, match=r"^data.prompt.max_prompt_length: a context of 16 tokens leaves no position"):
        sample(model, full, full_mask, gen, eos_id=39, pad_id=0)
