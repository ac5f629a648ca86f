"""Sample responses from left-padded prompts with the KV cache (``model.generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class GenerationConfig:
    """Sampling settings of the rollout (ALGORITHMS §3: T 0.8, top-p 0.9, rep. pen. 1.1 for PPO)."""

    max_new_tokens: int = field(default=32, metadata={"ge": 1})
    temperature: float = field(default=1.0, metadata={"gt": 0.0})
    top_p: float = field(default=1.0, metadata={"gt": 0.0, "le": 1.0})
    top_k: int = field(default=0, metadata={"ge": 0})
    """0 = no top-k filter."""
    repetition_penalty: float = field(default=1.0, metadata={"gt": 0.0})
    do_sample: bool = True
    """False = greedy (evaluation)."""


def response_mask_from_eos(response_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """(B, R) mask of tokens up to and including the first EOS, and (B,) whether an EOS occurred.

    Naive equivalent: per row, ``[1] * (row.index(eos) + 1) + [0] * rest`` (all ones if no EOS).
    """
    is_eos = response_ids == eos_id
    ended = is_eos.any(-1)
    # tokens strictly after the first EOS: the running count of EOS seen before them is > 0
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~seen_before).long(), ended


@torch.no_grad()
def sample(
    model: Any, prompt_ids: Tensor, prompt_mask: Tensor, gen: GenerationConfig, eos_id: int, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Generate responses for a left-padded batch of prompts.

    Position ids follow the attention mask (transformers derives them from it in generate), so
    a left-padded prompt generates exactly as it would alone.

    Args:
        model: a ``*ForCausalLM`` (put in eval mode for the call, restored after).
        prompt_ids, prompt_mask: (B, P).
    Returns:
        response_ids (B, R) with pad after each EOS, response_mask (B, R), ended (B,).
    """
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=gen.max_new_tokens,
            do_sample=gen.do_sample,
            temperature=gen.temperature if gen.do_sample else None,
            top_p=gen.top_p if gen.do_sample else None,
            top_k=gen.top_k if gen.do_sample else None,
            repetition_penalty=gen.repetition_penalty,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            use_cache=True,
        )
    finally:
        model.train(was_training)
    response_ids = out[:, prompt_ids.shape[1] :]
    response_mask, ended = response_mask_from_eos(response_ids, eos_id)
    response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad_id))
    return response_ids, response_mask, ended
