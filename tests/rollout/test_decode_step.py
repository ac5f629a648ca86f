"""One decoding step through the decoder layers (lit_rlhf/rollout/decode_step.py): the inlined
Llama-layout layers bit for bit against their forward, the prepacked projections, and the checks
that keep a model's own forward where they do not apply."""

from dataclasses import replace

import pytest
import torch

from lit_rlhf.core.masked import position_ids_from_mask
from lit_rlhf.data.collate import pad
from lit_rlhf.rollout.generate import GenerationConfig, sample
from lit_rlhf.utils.compat.transformers import cache_keyword


def same_llamas(tokenizer, n: int) -> list:
    """``n`` tiny Llamas (2 layers of width 32) with the same weights, each its own object (the
    layer step's verdicts are kept per model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    models = [LlamaForCausalLM(cfg) for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def test_layer_step_that_differs_from_the_forward_is_not_used(tokenizer, monkeypatch, caplog):
    """The layer-level decoding step is checked against the model's own forward on the first
    decoding step: a step that differs (simulated) is dropped with a warning, for good, and the
    tokens are the model forward's; models with a position-dependent rotary scaling never use it."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import lit_rlhf.rollout.generate as generate

    model, twin = same_llamas(tokenizer, 2)
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


def test_under_cpu_autocast_the_products_are_autocasts(tokenizer):
    """``bf16-mixed`` on the CPU: fp32 weights whose products autocast runs in bf16, which it does
    not do for oneDNN's prepacked operators (they refuse the bf16 inputs): nothing is prepacked
    then, and the sample is the one the model's own forward draws under autocast, also for a model
    whose layer step was judged (and prepacked) outside autocast before."""

    import lit_rlhf.rollout.decode_step as decode_step

    model, twin = same_llamas(tokenizer, 2)
    ids, mask = pad([[2, 10, 11, 12, 13], [2, 20]], tokenizer.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=8, temperature=1.3)
    with torch.inference_mode():  # judged in fp32 first: prepacked
        sample(model, ids, mask, gen, eos_id=-1, pad_id=0)
    assert decode_step.layer_step_verdict(model, prepacked=True) is True
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_step.layer_step_verdict(model, prepacked=True) is None  # not judged under autocast
        assert not decode_step.prepack_supported(model.lm_head.weight)
        torch.manual_seed(4)
        got, _, _, logps = sample(model, ids, mask, gen, eos_id=-1, pad_id=0, logprob_temperature=1.0)
        torch.manual_seed(4)
        plain = replace(gen, inline_layers=False, prepack=False)
        want, _, _, want_logps = sample(twin, ids, mask, plain, eos_id=-1, pad_id=0, logprob_temperature=1.0)
        assert decode_step.layer_step_verdict(model, prepacked=False) is True  # the exact step, judged here
    assert decode_step.prepack_supported(model.lm_head.weight)  # outside autocast: fp32 products, prepacked
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(logps, want_logps)


def test_a_oneDNN_failure_falls_back_to_plain_products_or_the_model_forward(tokenizer, monkeypatch, caplog):
    """Prepacking that raises (a build without those kernels) decodes with F.linear, with a
    warning; a layer step that raises at its first check decodes with the model's forward for
    good, with a warning. Either way the sampled tokens are the model forward's."""
    import logging

    import lit_rlhf.rollout.decode_step as decode_step
    import lit_rlhf.rollout.generate as generate

    models = same_llamas(tokenizer, 3)
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
