"""Multi-turn rollouts (``multiturn``): the hf engine's tokens/s when the rollout is a game of several
turns (lit_rlhf/rollout/agent.py: every active trajectory continued in one batched call per turn, its
whole context prefilled again) against one single-turn rollout of the same length per row. The bench
policy's shape, with the multi-turn tasks' chat tokenizer, taught the guessing game's form by a few
Adam steps first (so that its turns end; its guesses are the teacher's kind)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

GAME_STEPS = 80  # Adam steps on the teacher's games before timing


def _game_policy(s: dict):
    """(tokenizer, policy): the bench shape, the chat tokenizer, ``GAME_STEPS`` steps on the teacher's games."""
    import torch

    from lit_rlhf.data.agent_tasks import guess_traces
    from lit_rlhf.data.chat import render_with_assistant_mask
    from lit_rlhf.data.collate import pad
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    spec = ModelSpec(
        tiny=TinyLlamaConfig(
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=s["inter"],
            tie_word_embeddings=False,
        ),
        tokenizer="agent",
    )
    tok = build_tokenizer(spec)
    torch.manual_seed(0)
    model = build_causal_lm(spec, tok)
    rows = [render_with_assistant_mask(tok, t["messages"]) for t in guess_traces(512, 0, "train")]
    ids, mask = pad([r[0] for r in rows], tok.pad_token_id, "right")
    loss_mask, _ = pad([r[1] for r in rows], 0, "right")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    steps = GAME_STEPS if s["steps"] > 1 else 4
    for step in range(steps):
        batch = torch.arange(step * 32, step * 32 + 32) % ids.shape[0]
        logits = model(input_ids=ids[batch], attention_mask=mask[batch]).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[batch, 1:], reduction="none")
        loss = (nll * loss_mask[batch, 1:]).sum() / loss_mask[batch, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tok, model.eval()


def case_multiturn(models: Path, s: dict) -> dict:
    """Per round: one batch of ``batch`` games (T 0.7, budget ``new_tokens``, at most 8 turns) through
    the rollout path's sampler, then one single-turn sample of as many tokens per row as the games'
    longest (no stop token: every row runs its full length); tokens/s of each counts every
    response-side token (the environment's too: the multi-turn rollout prefills them)."""
    import torch

    from lit_rlhf.data.agent_tasks import GUESS, guess_prompts
    from lit_rlhf.data.chat import TokenizerTemplate
    from lit_rlhf.data.prompts import collate_prompts, encode_prompt
    from lit_rlhf.rollout.agent import AgentLoop, AgentSettings
    from lit_rlhf.rollout.collect import sample_responses
    from lit_rlhf.rollout.generate import GenerationConfig, sample

    tok, model = _game_policy(s)
    games = guess_prompts(s["batch"], 0, "test")
    items = [(encode_prompt(tok, GUESS, 8, TokenizerTemplate())[0], GUESS, {"secret": g["secret"]}) for g in games]
    batch = collate_prompts(items, tok.pad_token_id)
    gen = GenerationConfig(max_new_tokens=s["new_tokens"], temperature=0.7)
    agent = AgentLoop(AgentSettings(environment={"_target_": "lit_rlhf.data.agent_tasks.GuessNumber"}, max_turns=8))
    multi, single, turns, lengths = [], [], [], []
    try:
        for round_ in range(s["warmup"] + s["steps"]):
            torch.manual_seed(round_)
            start = time.perf_counter()
            with torch.no_grad():
                _, _, out = sample_responses(model, batch, tok, gen, None, 1, None, agent)
            multi_s = time.perf_counter() - start
            tokens = int(out.attention_mask.sum())
            width = int(out.attention_mask.sum(1).max())
            stats = agent.take_stats()
            start = time.perf_counter()
            flat = GenerationConfig(max_new_tokens=width, temperature=0.7)
            _, m, _, _ = sample(model, out.prompt_ids, out.prompt_mask, flat, -1, tok.pad_token_id)
            single_s = time.perf_counter() - start
            if round_ >= s["warmup"]:
                multi.append(tokens / multi_s)
                single.append(int(m.sum()) / single_s)
                turns.append(stats["turns"])
                lengths.append(tokens / s["batch"])
    finally:
        agent.close()
    ours, flat_rate = statistics.median(multi), statistics.median(single)
    return {
        "step_s": s["batch"] * statistics.median(lengths) / ours,
        "multi_tokens_per_s": ours,
        "single_tokens_per_s": flat_rate,
        "single_over_multi": flat_rate / ours,
        "turns": statistics.mean(turns),
        "tokens_per_trajectory": statistics.mean(lengths),
    }
