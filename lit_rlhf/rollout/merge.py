"""Merged batches of the asynchronous rollouts' producer (``algo.rollout.merge_rollouts``;
docs/async.md §1): the prompts of several RL iterations sampled as one batch, and the sample cut back
into each iteration's rollout at the widths it has sampled alone (lit_rlhf/rollout/producer.py
decides which tickets merge)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


def merged_prompt_limit(model: Any, gen: Any, agent: Any) -> int | None:
    """The longest prompt, in tokens, that a merged batch may hold (None: any). The hf loop stops
    every row of a batch where the longest context runs out of the model's positions
    (rollout/generate.py ``_within_positions``), so a long prompt of one ticket would cut another's
    responses shorter than they are sampled alone; below this length no row is ever cut (a
    multi-turn row's context is its rendered prompt and at most ``max_new_tokens`` more). A vLLM
    engine budgets each request alone. Multi-turn prompts are rendered with their tools in the
    rollout, longer than the loader's: bounded only by ``data.prompt.max_prompt_length``, without
    which such runs sample one ticket at a time where positions are limited (-1). ``gen``: the
    run's GenerationConfig; ``agent``: its multi-turn settings (None: one turn)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if gen.engine != "hf" or not limit:
        return None
    room = int(limit) - gen.max_new_tokens
    if agent is None:
        return room
    rendered = agent.max_prompt_length
    return None if rendered is not None and rendered <= room else -1


def prompt_tokens(batch: dict[str, Any]) -> int:
    """The longest prompt of a batch, in tokens."""
    return int(batch["prompt_mask"].sum(1).max()) if batch["prompt_mask"].numel() else 0


PROMPT_KEYS = {"prompt_ids", "prompt_mask", "prompts", "columns"}
"""What the prompt loader's batches hold (lit_rlhf/data/prompts.py ``collate_prompts``): the keys a
merged batch is made of."""


def mergeable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two prompt batches can be sampled as one: the prompt loader's keys alone, with the
    same dataset columns."""
    if set(a) != set(b) or not set(a) <= PROMPT_KEYS:
        return False
    return set(a.get("columns") or {}) == set(b.get("columns") or {})


def merged_batch(batches: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """The prompts of several tickets as one batch, in order: their ids and masks left-padded to the
    widest (``pad_id``), their texts and dataset columns one after the other."""
    width = max(b["prompt_ids"].shape[1] for b in batches)

    def left(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=fill)

    out = {
        "prompt_ids": torch.cat([left(b["prompt_ids"], pad_id) for b in batches]),
        "prompt_mask": torch.cat([left(b["prompt_mask"], 0) for b in batches]),
        "prompts": [p for b in batches for p in b["prompts"]],
    }
    if "columns" in batches[0]:
        out["columns"] = {k: [x for b in batches for x in b["columns"][k]] for k in batches[0]["columns"]}
    return out


def split_sample(drawn: tuple, rows: list[int]) -> list[tuple]:
    """rollout/collect.py ``sample_responses``' output for a :func:`merged_batch` cut into each ticket's (its
    ``rows``, in order), each cut to its own width: the leading prompt columns and trailing response
    columns that only other tickets' rows use are dropped, so a ticket's sample has the shapes it has
    sampled alone (the hf loop and a vLLM engine both stop at the batch's longest response)."""
    batch, sampled, turns = drawn
    parts, start = [], 0
    for n in rows:
        at = slice(start, start + n)
        start += n
        used = batch["prompt_mask"][at].any(0).nonzero()
        lead = int(used[0]) if len(used) else batch["prompt_mask"].shape[1]
        attended = (turns.attention_mask if turns is not None else sampled[1])[at].any(0).nonzero()
        width = int(attended[-1]) + 1 if len(attended) else 1
        cut = functools.partial(_cut, rows=at)

        prompt, response = slice(lead, None), slice(0, width)
        part = {
            k: v[at] if isinstance(v, list) else v for k, v in batch.items() if k not in ("prompt_ids", "prompt_mask")
        }
        if "columns" in part:
            part["columns"] = {k: v[at] for k, v in part["columns"].items()}
        if turns is None:
            ids, mask, ended, logps = sampled
            cuts = (cut(ids, response), cut(mask, response), cut(ended), cut(logps, response))
            part.update(prompt_ids=cut(batch["prompt_ids"], prompt), prompt_mask=cut(batch["prompt_mask"], prompt))
            parts.append((part, cuts, None))
            continue
        t = dataclasses.replace(
            turns,
            prompt_ids=cut(turns.prompt_ids, prompt),
            prompt_mask=cut(turns.prompt_mask, prompt),
            response_ids=cut(turns.response_ids, response),
            response_mask=cut(turns.response_mask, response),
            attention_mask=cut(turns.attention_mask, response),
            ended=cut(turns.ended),
            sampler_logprobs=cut(turns.sampler_logprobs, response),
            **{f: getattr(turns, f)[at] for f in ("texts", "env_reward", "tool_calls", "turns", "counts")},
        )
        part.update(prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask)
        parts.append((part, (t.response_ids, t.response_mask, t.ended, t.sampler_logprobs), t))
    return parts


def _cut(t: torch.Tensor | None, cols: slice = slice(None), *, rows: slice) -> torch.Tensor | None:
    """The ``rows`` of ``t`` (and its columns ``cols``, a 2-D one) as a tensor of their own; None: None."""
    return None if t is None else (t[rows, cols] if t.dim() > 1 else t[rows]).clone()
