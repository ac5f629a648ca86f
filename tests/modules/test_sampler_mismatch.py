"""The sampler's own log-probs (the hf engine's decoding loop), the mismatch monitor and truncated
importance sampling in the one RL iteration (docs/algorithms.md §2.10)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.ppo import data, fit, make


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_decoding_loops_logprobs_equal_the_trainers_recomputation(saved_models, tokenizer, temperature):
    """The inlined KV-cache loop's log-prob of each sampled token (at the trainer's temperature)
    against the padding-free training forward's: fp32 agreement (measured here: max gap 9.5e-7 at
    temperature 1, 4.8e-7 at 0.7; bound 1e-4)."""
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import generate_and_score
    from lit_rlhf.rollout.generate import GenerationConfig

    policy = freeze(build_causal_lm(ModelSpec(name_or_path=saved_models[0]), tokenizer))
    prompts = ["the dog", "a small cat", "the", "every happy bird sings"] * 4
    batch = collate_prompts([(encode_prompt(tokenizer, p, 16)[0], p) for p in prompts], tokenizer.pad_token_id)
    gen = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, repetition_penalty=1.1)
    torch.manual_seed(0)
    r = generate_and_score(
        policy, batch, tokenizer, gen, logprob_temperature=temperature, padding_free=True, sampler_logprobs=True
    )
    mask = r.response_mask.bool()
    gap = (r.sampler_logprobs - r.logprobs).abs()[mask]
    assert gap.max().item() < 1e-4 and r.sampler_logprobs[~mask].abs().max().item() == 0.0
    assert (r.sampler_logprobs[mask] < 0).all()
    torch.manual_seed(0)
    plain = generate_and_score(policy, batch, tokenizer, gen, logprob_temperature=temperature, padding_free=True)
    assert torch.equal(plain.response_ids, r.response_ids) and plain.sampler_logprobs is None  # the same draws


def test_monitor_and_tis_in_ppo(saved_models, tokenizer):
    """monitor_sampler logs the mismatch; with the hf engine it is fp32 noise, so TIS weights are 1
    up to that noise and the TIS update equals the plain one to 1e-5."""
    results = []
    for extra in ({}, {"monitor_sampler": True}, {"rollout_correction": "tis", "tis_cap": 2.0}):
        torch.manual_seed(0)
        m = make(saved_models, tokenizer, kl_coef=0.05, **extra)
        trainer = fit(m, data(tokenizer), max_steps=4)  # 2 iterations x 2 minibatches (separate rollout passes)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        results.append(({k: v.detach().clone() for k, v in m.actor.state_dict().items()}, metrics))
    (plain, s0), (_, s1), (tis, s2) = results
    assert "rollout/sampler_kl" not in s0
    for s in (s1, s2):
        # measured: sampler_kl 0.0 (k3 of gaps < 1e-6 rounds to 0 in fp32), max gap 4.8e-7
        assert 0.0 <= s["rollout/sampler_kl"] < 1e-8 and s["rollout/sampler_logprob_diff_max"] < 1e-4
    for k in plain:
        torch.testing.assert_close(plain[k], tis[k], atol=1e-5, rtol=1e-5, msg=k)


def test_tis_weights_reach_the_grpo_loss(saved_models, tokenizer, monkeypatch):
    """GRPO takes the same weights (the one iteration's ``importance_weights``): a sampler made to
    disagree by a known amount scales the surrogate exactly as min(e^{gap}, C)."""
    from lit_rlhf.modules.rl import RLModule
    from tests.modules.test_grpo_module import data as grpo_data
    from tests.modules.test_grpo_module import fit as grpo_fit
    from tests.modules.test_grpo_module import make as grpo_make

    seen = []
    original = RLModule.importance_weights

    def shifted(self, mb, mask):  # the sampler 0.3 nats less likely than the trainer on every token
        mb.sampler_logprobs = mb.logprobs - 0.3
        w, stats = original(self, mb, mask)
        seen.append((w, mask))
        return w, stats

    monkeypatch.setattr(RLModule, "importance_weights", shifted)
    m = grpo_make(saved_models, tokenizer, rollout_correction="tis", tis_cap=1.2)
    trainer = grpo_fit(m, grpo_data(tokenizer), max_steps=1)
    assert trainer.global_step == 1 and seen
    for w, mask in seen:
        on = mask.bool()
        assert torch.allclose(w[on], torch.full_like(w[on], 1.2)) and (w[~on] == 0).all()  # e^0.3 = 1.35, capped at 1.2
    assert math.isfinite(float(trainer.callback_metrics["policy/loss"]))
    assert float(trainer.callback_metrics["rollout/correction_masked_frac"]) == 0.0
    assert float(trainer.callback_metrics["rollout/correction_weight_p50"]) == pytest.approx(1.2)


def test_a_band_correction_drops_the_tokens_outside_it_in_training(saved_models, tokenizer, monkeypatch):
    """icepop with the band [0.5, 1.2]: a sampler 0.3 nats less likely (r = 1.35) on every token drops
    them all, and the policy-gradient term of the update is exactly 0 (the KL term stays)."""
    from lit_rlhf.modules.rl import RLModule
    from tests.modules.test_grpo_module import data as grpo_data
    from tests.modules.test_grpo_module import fit as grpo_fit
    from tests.modules.test_grpo_module import make as grpo_make

    original = RLModule.importance_weights

    def shifted(self, mb, mask):
        mb.sampler_logprobs = mb.logprobs - 0.3
        return original(self, mb, mask)

    monkeypatch.setattr(RLModule, "importance_weights", shifted)
    m = grpo_make(
        saved_models, tokenizer, rollout_correction="icepop", correction_band_low=0.5, correction_band_high=1.2
    )
    trainer = grpo_fit(m, grpo_data(tokenizer), max_steps=1)
    assert float(trainer.callback_metrics["rollout/correction_masked_frac"]) == 1.0
    assert float(trainer.callback_metrics["policy/loss"]) == 0.0
