from dataclasses import replace

import pytest
import torch

from lit_rlhf.core.masked import position_ids_from_mask
from lit_rlhf.data.collate import pad
from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.rollout.forward import response_logprobs
from lit_rlhf.rollout.generate import GenerationConfig, response_mask_from_eos, sample
from lit_rlhf.utils.compat.transformers import cache_keyword


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


@pytest.fixture
def policy(tiny_spec, tokenizer):
    torch.manual_seed(0)
    return build_causal_lm(tiny_spec, tokenizer)


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


PROMPTS, RESPONSES = [[2, 10, 11], [2, 12], [2, 13, 14, 15]], [[20, 21, 3], [22, 3], [23]]


def prompt_response_batch():
    """Left-padded prompts + right-padded responses, as a rollout lays them out."""
    p_ids, p_mask = pad(PROMPTS, 0, "left")
    r_ids, r_mask = pad(RESPONSES, 0, "right")
    return PROMPTS, RESPONSES, p_ids, r_mask, torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)


@pytest.mark.parametrize("padding_free", [False, True])
def test_response_logprobs_match_naive_and_ignore_padding(policy, padding_free):
    from lit_rlhf.models.packed import packing_verdict

    prompts, responses, p_ids, r_mask, ids, mask = prompt_response_batch()
    with torch.no_grad():
        lp, ent = response_logprobs(policy, ids, mask, p_ids.shape[1], with_entropy=True, padding_free=padding_free)
        if padding_free:
            assert packing_verdict(policy) is True
        for i, (p, r) in enumerate(zip(prompts, responses)):
            full = torch.tensor([p + r])
            logp = policy(input_ids=full).logits[0].log_softmax(-1)
            for t, tok in enumerate(r):
                assert lp[i, t].item() == pytest.approx(logp[len(p) + t - 1, tok].item(), abs=1e-5)
                probs = logp[len(p) + t - 1].exp()
                assert ent[i, t].item() == pytest.approx(-(probs * logp[len(p) + t - 1]).sum().item(), abs=1e-4)


def test_packed_response_logprobs_have_the_padded_gradients(policy):
    """The update's forward (with grad) packed: same gradients of a masked loss as padded."""
    _, _, p_ids, r_mask, ids, mask = prompt_response_batch()
    grads = []
    for padding_free in (False, True):
        lp, _ = response_logprobs(policy, ids, mask, p_ids.shape[1], padding_free=padding_free)
        loss = (lp * r_mask * torch.tensor([[1.0], [-2.0], [0.5]])).sum()
        grads.append(torch.autograd.grad(loss, [p for p in policy.parameters() if p.requires_grad]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


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


def test_layer_step_that_differs_from_the_forward_is_not_used(tokenizer, monkeypatch, caplog):
    """The layer-level decoding step is checked against the model's own forward on the first
    decoding step: a step that differs (simulated) is dropped with a warning, for good, and the
    tokens are the model forward's; models with a position-dependent rotary scaling never use it."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.generate as generate

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model, twin = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    twin.load_state_dict(model.state_dict())
    ids, mask = pad([[2, 10, 11, 12, 13], [2, 20]], tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=10, temperature=1.3)
    real = generate.LayerStep.__call__
    calls = []

    def off_by_a_bit(self, **kw):
        calls.append(1)
        out = real(self, **kw)
        out.logits = out.logits + 0.5
        return out

    monkeypatch.setattr(generate.LayerStep, "__call__", lambda self, **kw: off_by_a_bit(self, **kw))
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.rollout.decode_step"):
        torch.manual_seed(4)
        got = sample(model, ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert generate.layer_step_verdict(model, prepacked=True) is False and "decoding with its forward" in caplog.text
    assert len(calls) == 1  # the check only
    torch.manual_seed(4)  # the twin decodes with the model's forward throughout (no layer step at all)
    assert got.tolist() == sample(twin, ids, mask, replace(gen, inline_layers=False), eos_id=-1, pad_id=0)[0].tolist()
    assert generate.layer_step_verdict(twin, prepacked=True) is None and len(calls) == 1
    torch.manual_seed(4)
    sample(model, ids, mask, gen, eos_id=-1, pad_id=0)
    assert len(calls) == 1  # remembered: not tried again
    sample(model, ids, mask, replace(gen, prepack=False), eos_id=-1, pad_id=0)  # the exact step is judged on its own
    assert len(calls) == 2 and generate.layer_step_verdict(model, prepacked=False) is False
    dynamic = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        )
    )
    assert generate.LayerStep.supported(model) and not generate.LayerStep.supported(dynamic)


def _decoder_and_batch(arch, attn, kv_heads, dtype, hidden, intermediate, steps):
    """A 2-layer decoder of ``arch`` with non-trivial norms and biases, three left-padded prompts,
    the decode masks of ``steps`` steps and the prompts' positions."""
    import transformers

    import lit_rlhf.rollout.generate as generate

    config_class, model_class = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[arch]
    cfg = getattr(transformers, config_class)(
        vocab_size=40,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        attn_implementation=attn,
        sliding_window=None,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).to(dtype).eval()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            p.data.add_(torch.randn_like(p) * 0.1)
    ids, mask = pad([[2, 10, 11, 12, 13], [2, 20], [2, 30, 31]], 0, "left")
    return model, ids, mask, generate._decode_mask_table(model, mask, steps), position_ids_from_mask(mask)


@pytest.mark.parametrize(
    "arch, attn, kv_heads, dtype",
    [
        ("llama", "sdpa", 4, torch.float32),
        ("llama", "eager", 2, torch.float32),
        ("llama", "sdpa", 1, torch.bfloat16),
        ("mistral", "sdpa", 2, torch.float32),
        ("qwen2", "eager", 2, torch.float32),
        ("qwen2", "sdpa", 4, torch.bfloat16),
    ],
)
def test_inlined_layers_decode_bit_for_bit_as_their_forward(arch, attn, kv_heads, dtype):
    """Decoding with the Llama-layout layers inlined gives exactly (torch.equal) the logits of the
    same steps through each layer's own forward: grouped-query attention, q/k/v biases (Qwen2),
    eager and sdpa masks, bf16, left-padded prompts, over several steps of a shared KV cache."""
    import lit_rlhf.rollout.decode_step as decode_step
    import lit_rlhf.rollout.kv_cache as kv_cache

    model, ids, mask, table, positions = _decoder_and_batch(arch, attn, kv_heads, dtype, 32, 64, steps := 6)

    def decode(inline: bool) -> torch.Tensor:
        cache = kv_cache.preallocated_cache(model, ids.shape[1] + steps)
        with torch.no_grad():
            model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(): cache}
            )
            step = decode_step.LayerStep(model, ids.shape[1] + steps + 1)
            assert step.inline == [True, True]
            step.inline = [inline] * 2
            tokens, pos, logits = torch.tensor([[3], [4], [5]]), positions[:, -1:] + 1, []
            for t in range(steps):
                out = step(
                    input_ids=tokens,
                    attention_mask=table[..., : ids.shape[1] + t + 1],
                    position_ids=pos,
                    **{cache_keyword(): cache},
                )
                logits.append(out.logits)
                tokens, pos = out.logits[:, -1].float().argmax(-1, keepdim=True), pos + 1
        return torch.cat(logits, 1)

    inlined, layered = decode(True), decode(False)
    assert inlined.dtype == dtype and torch.equal(inlined, layered)


def test_layers_with_hooks_adapters_or_another_layout_are_not_inlined():
    """A forward hook, a peft LoRA wrapper or a layer of another layout (Qwen3's q/k norms) keeps
    the layer's own forward: inlining would skip what they add."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    import lit_rlhf.rollout.decode_step as decode_step

    small = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = LlamaForCausalLM(LlamaConfig(**small))
    assert [decode_step._inlinable(layer) for layer in model.model.layers] == [True, True]
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert [decode_step._inlinable(layer) for layer in model.model.layers] == [True, False]
    handle.remove()
    lora = peft.get_peft_model(LlamaForCausalLM(LlamaConfig(**small)), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert not any(decode_step._inlinable(layer) for layer in lora.base_model.model.model.layers)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8))
    assert not any(decode_step._inlinable(layer) for layer in qwen3.model.layers)


def test_response_logits_same_with_and_without_logits_to_keep(policy):
    """The LM head on the response positions only gives the logits a full forward gives there;
    models whose forward has no ``logits_to_keep`` get the full forward, sliced."""
    from lit_rlhf.rollout.forward import _takes_logits_to_keep, response_logits

    class NoKeep(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    ids, mask = pad([[2, 10, 11, 20, 21, 3], [2, 12, 22, 3]], 0, "left")
    assert _takes_logits_to_keep(policy) and not _takes_logits_to_keep(NoKeep(policy))
    with torch.no_grad():
        kept = response_logits(policy, ids, mask, 3)
        full = response_logits(NoKeep(policy), ids, mask, 3)
        naive = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[
            :, 2:-1
        ]
    assert kept.shape == (2, 3, policy.config.vocab_size)
    torch.testing.assert_close(kept, naive)
    torch.testing.assert_close(full, naive)


def test_truncated_responses_are_scored_with_an_eos_like_the_retokenizing_path(tiny_spec, tokenizer):
    """The reward model reads x + y + EOS (docs/algorithms.md §1). Reusing the policy's ids must give the
    scores that decoding + re-tokenizing (encode_pair appends the EOS) gives, truncated rows too."""
    from lit_rlhf.data.templates import get_template
    from lit_rlhf.models.reward import build_reward_model
    from lit_rlhf.rollout.scorers import ModelScorer, append_eos_to_truncated

    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[pad_id, 7, 8, 20, 21, eos], [4, 5, 6, 22, 23, 24]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ended = torch.tensor([True, False])
    new_ids, new_mask = append_eos_to_truncated(ids, mask, ended, eos, pad_id)
    assert new_ids[:, :6].tolist() == ids.tolist() and new_ids[:, 6].tolist() == [pad_id, eos]
    assert new_mask[:, 6].tolist() == [0, 1]
    assert append_eos_to_truncated(ids, mask, torch.tensor([True, True]), eos, pad_id)[0] is ids

    torch.manual_seed(0)
    rm = build_reward_model(tiny_spec, tokenizer).eval()
    scorer = ModelScorer(rm, tokenizer, tokenizer, get_template("plain"), 64)
    assert scorer.same_vocab
    words = [w for w in tokenizer.get_vocab() if w.isalpha()][:8]
    prompts, responses = [" ".join(words[:2]), " ".join(words[2:5])], [" ".join(words[5:7]), " ".join(words[5:8])]
    p_ids, p_mask = pad([tokenizer(p)["input_ids"] for p in prompts], pad_id, "left")
    r = [tokenizer(x, add_special_tokens=False)["input_ids"] for x in responses]
    r_ids, r_mask = pad([r[0] + [eos], r[1]], pad_id, "right")  # row 0 ended, row 1 truncated
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    fast = scorer(ids, mask, prompts, responses, ended)
    scorer.same_vocab = False
    slow = scorer(ids, mask, prompts, responses, ended)
    torch.testing.assert_close(fast, slow)
    with torch.no_grad():
        no_eos = rm(ids, mask)  # what the old path scored: the truncated row at its last token
    assert abs(float(no_eos[1] - fast[1])) > 1e-4 and abs(float(no_eos[0] - fast[0])) < 1e-5


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


@pytest.mark.parametrize("arch, attn, kv_heads", [("llama", "sdpa", 4), ("llama", "eager", 2), ("qwen2", "sdpa", 2)])
def test_prepacked_projections_decode_like_the_layer_forward(arch, attn, kv_heads):
    """With the projections prepacked (fp32 on CPU: q/k/v as one oneDNN product, gate/up as one,
    the LM head too) the decoding steps' logits equal those of the layers' own forwards to float
    rounding (another summation order: |Δ| ≤ 1e-5 of their scale), greedy decoding picks the
    same tokens, and the packed path is the one that ran (grouped-query attention, q/k/v biases)."""
    import lit_rlhf.rollout.decode_step as decode_step
    import lit_rlhf.rollout.kv_cache as kv_cache

    model, ids, mask, table, positions = _decoder_and_batch(arch, attn, kv_heads, torch.float32, 64, 96, steps := 6)
    calls = []
    real_call = decode_step._Packed.__call__

    def counted(self, x):
        calls.append(1)
        return real_call(self, x)

    def decode(rows) -> tuple[torch.Tensor, torch.Tensor]:
        cache = kv_cache.preallocated_cache(model, ids.shape[1] + steps)
        with torch.no_grad():
            model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(): cache}
            )
            step = decode_step.LayerStep(model, ids.shape[1] + steps + 1, rows=rows)
            assert step.inline == [True, True]
            if rows is None:
                step.inline = [False, False]  # each layer's own forward
            tokens, pos, logits = torch.tensor([[3], [4], [5]]), positions[:, -1:] + 1, []
            chosen = []
            for t in range(steps):
                out = step(
                    input_ids=tokens,
                    attention_mask=table[..., : ids.shape[1] + t + 1],
                    position_ids=pos,
                    **{cache_keyword(): cache},
                )
                logits.append(out.logits)
                tokens, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
                chosen.append(tokens)
        return torch.cat(logits, 1), torch.cat(chosen, 1)

    decode_step._Packed.__call__ = counted
    try:
        packed, packed_tokens = decode(rows=3)
    finally:
        decode_step._Packed.__call__ = real_call
    assert len(calls) == steps * (2 * 4 + 1)  # per step: qkv, o, gate/up, down in each layer, and the head
    layered, layered_tokens = decode(rows=None)
    scale = layered.abs().max()
    assert 0 < (packed - layered).abs().max() <= 1e-5 * scale or torch.equal(packed, layered)
    assert torch.equal(packed_tokens, layered_tokens)


def test_prepacking_only_for_fp32_cpu_weights_of_plain_layers():
    """bf16 weights keep the exact inlined path (prepacking is fp32 only); a layer with a hook is
    neither inlined nor packed; without ``rows`` nothing is packed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.decode_step as decode_step

    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    )
    assert decode_step.prepack_supported(model.lm_head.weight)
    step = decode_step.LayerStep(model, 16, rows=2)
    assert all(p is not None for p in step.packed) and step.packed_head is not None
    assert all(p is None for p in decode_step.LayerStep(model, 16).packed)
    handle = model.model.layers[1].register_forward_hook(lambda *a: None)
    step = decode_step.LayerStep(model, 16, rows=2)
    assert step.packed[0] is not None and step.packed[1] is None
    handle.remove()
    half = model.to(torch.bfloat16)
    assert not decode_step.prepack_supported(half.lm_head.weight)
    assert all(p is None for p in decode_step.LayerStep(half, 16, rows=2).packed)


def test_a_oneDNN_failure_falls_back_to_plain_products_or_the_model_forward(tokenizer, monkeypatch, caplog):
    """Prepacking that raises (a build without those kernels) decodes with F.linear, with a
    warning; a layer step that raises at its first check decodes with the model's forward for
    good, with a warning. Either way the sampled tokens are the model forward's."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.decode_step as decode_step
    import lit_rlhf.rollout.generate as generate

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    models = [LlamaForCausalLM(cfg) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    ids, mask = pad([[2, 10, 11, 12], [2, 20]], tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    # the model's forward throughout: the expected tokens
    expected = sample(models[0], ids, mask, replace(gen, inline_layers=False), eos_id=-1, pad_id=0)[0]

    def unavailable(*args, **kwargs):
        raise RuntimeError("no such kernel")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="lit_rlhf.rollout.decode_step"):
        m.setattr(torch.ops.mkldnn, "_reorder_linear_weight", unavailable)
        assert all(p is None for p in decode_step.LayerStep(models[1], 16, rows=2).packed)
        got = sample(models[1], ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert "prepacking the decoding weights failed" in caplog.text
    assert generate.layer_step_verdict(models[1], prepacked=False) is True and torch.equal(
        got, expected
    )  # exact inlined path
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="lit_rlhf.rollout.decode_step"):
        m.setattr(decode_step._Packed, "__call__", unavailable)
        got = sample(models[2], ids, mask, gen, eos_id=-1, pad_id=0)[0]
    assert generate.layer_step_verdict(models[2], prepacked=True) is False and "failed (no such kernel)" in caplog.text
    assert torch.equal(got, expected)


def test_prepacking_is_skipped_when_its_copy_would_not_fit(monkeypatch, caplog):
    """The prepacked copy (4 bytes per projection and head weight) is made only while it takes at
    most half of the memory available; otherwise F.linear decodes, with one warning per model."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.decode_step as decode_step

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            tie_word_embeddings=False,
        )
    )
    layer = 4 * 32 * 32 + 3 * 32 * 64  # q, k, v, o and gate, up, down
    need = 4 * (2 * layer + 40 * 32)
    monkeypatch.setattr(decode_step, "_available_memory", lambda: 2 * need)
    assert all(p is not None for p in decode_step.LayerStep(model, 16, rows=2).packed)
    monkeypatch.setattr(decode_step, "_available_memory", lambda: 2 * need - 1)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.rollout.decode_step"):
        for _ in range(2):
            step = decode_step.LayerStep(model, 16, rows=2)
            assert all(p is None for p in step.packed) and step.packed_head is None and step.inline == [True, True]
    assert caplog.text.count("would take") == 1
