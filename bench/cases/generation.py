"""Generation: bare ``model.generate`` with the KV cache against lit_rlhf's sampler (same prompts, T 0.7)."""

from __future__ import annotations

import statistics
from pathlib import Path

from .common import prompts, timed


def case_generate_bare(models: Path, s: dict) -> dict:
    """Bare ``model.generate`` with the KV cache (the reference for generation speed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_rlhf.data.collate import pad
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    model = AutoModelForCausalLM.from_pretrained(models / "policy").eval()
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")

    @torch.no_grad()
    def go():
        torch.manual_seed(0)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=s["new_tokens"],
            min_new_tokens=s["new_tokens"],
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            pad_token_id=tok.pad_token_id,
            use_cache=True,
        )

    t = timed(go, s["warmup"], s["steps"])
    return {"step_s": t, "tokens_per_s": s["batch"] * s["new_tokens"] / t}


def case_generate_ours(models: Path, s: dict) -> dict:
    import torch

    from lit_rlhf.data.collate import pad
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.generate import GenerationConfig, sample

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    model = build_causal_lm(spec, tok)
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=s["new_tokens"], temperature=0.7)
    tokens = []

    def go():
        torch.manual_seed(0)
        _, m, _, _ = sample(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id)
        tokens.append(int(m.sum()))

    t = timed(go, s["warmup"], s["steps"])
    return {
        "step_s": t,
        "tokens_per_s": s["batch"] * s["new_tokens"] / t,
        "response_tokens_mean": statistics.mean(tokens),
    }
