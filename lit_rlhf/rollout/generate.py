"""Sample responses from left-padded prompts with the KV cache (``model.generate``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.masked import position_ids_from_mask
from lit_rlhf.rollout.config import GenerationConfig
from lit_rlhf.rollout.decode_step import LayerStep, layer_step_ok, layer_step_verdict
from lit_rlhf.utils.compat.transformers import cache_keyword, output_cache
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.distributed import all_reduce_min
from lit_rlhf.utils.facts import recall

log = logging.getLogger(__name__)

StopIds = int | Sequence[int]
"""EOS, or EOS and the chat template's end-of-turn token(s) (rollout/collect.py: stop_token_ids)."""


def is_stop(tokens: Tensor, stop: StopIds | Tensor) -> Tensor:
    """Boolean tensor: which of ``tokens`` end a response (equal to the stop id, or any of them)."""
    if isinstance(stop, int):
        return tokens == stop
    return torch.isin(tokens, torch.as_tensor(stop, device=tokens.device))


def response_mask_from_eos(response_ids: Tensor, eos_id: StopIds) -> tuple[Tensor, Tensor]:
    """(B, R) mask of tokens up to and including the first stop token (EOS, or any of the ids
    given), and (B,) whether one occurred.

    Naive equivalent: per row, ``[1] * (row.index(eos) + 1) + [0] * rest`` (all ones if no EOS).
    """
    is_eos = is_stop(response_ids, eos_id)
    ended = is_eos.any(-1)
    # tokens strictly after the first EOS: the running count of EOS seen before them is > 0
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~seen_before).long(), ended


def process_logits(logits: Tensor, seen: Tensor | None, gen: GenerationConfig) -> Tensor:
    """Next-token logits (B, V) after repetition penalty, temperature, top-k and top-p, in the
    order transformers applies them (processors, then warpers). Filtered tokens get −inf.

    Args:
        logits: (B, V) float32.
        seen: (B, V) bool, tokens already in the prompt or response (repetition penalty only).
    """
    if gen.repetition_penalty != 1.0 and seen is not None:
        # CTRL (Keskar et al. 2019): divide positive logits of seen tokens, multiply negative ones
        penalized = torch.where(logits > 0, logits / gen.repetition_penalty, logits * gen.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if not gen.do_sample:
        return logits
    if gen.temperature != 1.0:
        logits = logits / gen.temperature
    if gen.top_k and gen.top_k < logits.shape[-1]:
        kth = torch.topk(logits, gen.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if gen.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked before it already hold top_p of the mass (keeps ≥ 1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= gen.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: Tensor) -> Tensor:
    """(B,) one token per row of ``probs`` (B, V): ``torch.multinomial(probs, 1)`` token for token.
    For one sample multinomial draws q ~ Exp(1) of the shape of ``probs`` from the default
    generator and takes ``argmax(probs / q)`` (the exponential form of the Gumbel-max trick); this
    does the same, draw for draw (tested), without multinomial's validity checks, three host
    syncs per call (the decoding loop checks the probabilities once per rollout instead)."""
    q = torch.empty_like(probs).exponential_()
    return torch.div(probs, q, out=q).argmax(-1)


def _decode_mask_table(model: Any, mask: Tensor, max_new_tokens: int) -> Tensor | None:
    """(B, 1, 1, P + max_new_tokens) attention mask of every decoding step, built once, or None
    where the model needs transformers' own masks.

    A 2-D mask makes transformers build the 4-D mask again at every decoding forward (a large
    share of a small model's step, measured in ``make bench``). One query token sees the prompt's
    real tokens and everything generated so far, so step k's mask is this table's first P + k + 1
    columns. Only for plain full-attention models under eager/sdpa, whose 4-D format is known
    (sdpa: bool, True = attend; eager: additive 0 / dtype min); sliding-window or chunked
    attention keeps the 2-D path.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if impl not in ("sdpa", "eager") or any(t != "full_attention" for t in layer_types):
        return None
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        return None
    table = torch.cat([mask.bool(), mask.new_ones(mask.shape[0], max_new_tokens, dtype=torch.bool)], 1)[:, None, None]
    if impl == "sdpa":
        return table
    dtype = next(model.parameters()).dtype
    return torch.where(table, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def _layer_step_usable(model: Any, cache: Any) -> bool:
    """:class:`LayerStep` applies: the standard layout, and a cache of preallocated layers only
    (the verdict rewinds them)."""
    from lit_rlhf.rollout.kv_cache import PreallocatedLayer

    return LayerStep.supported(model) and all(type(layer) is PreallocatedLayer for layer in cache.layers)


def _all_ranks_done(done: bool, device: torch.device) -> bool:
    """Whether every rank is done, so that all ranks run the same number of decoding forwards:
    forwards of sharded weights outside a gathered context gather them collectively (ZeRO-3,
    FSDP) and would hang otherwise. The stages sample from gathered weights, where this costs one
    small all-reduce per token."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return done
    flag = torch.tensor([0.0 if done else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0


def _within_positions(model: Any, context: int, gen: GenerationConfig, device: torch.device) -> GenerationConfig:
    """``gen`` with at most as many new tokens as the model has positions left after the longest
    context (``context`` real tokens, positions counting them): decoding stops there, as vLLM stops a
    request at its ``max_model_len`` (by default the model's ``max_position_embeddings``), instead of
    raising deep in the forward (GPT-2's learned positions) or running past what the model was
    trained for (rotary ones). The same number on every rank (its decoding steps are collective).
    Warned once per model; a context that leaves no room at all is an error naming the keys."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not limit:
        return gen
    room = int(all_reduce_min(torch.tensor([float(limit - context)], device=device)).item())
    if room >= gen.max_new_tokens:
        return gen
    name = type(model).__name__
    if room < 1:
        raise ConfigError(
            "data.prompt.max_prompt_length",
            f"a context of {limit - room} tokens leaves no position of {name}'s {limit} "
            "(max_position_embeddings) for a response: shorten the prompts (or the turns before)",
        )

    def warn() -> bool:
        log.warning(
            "responses are cut at %s's %d positions (max_position_embeddings): contexts of up to %d tokens + "
            "algo.generation.max_new_tokens=%d do not fit (as vLLM cuts them at its max_model_len); "
            "lower data.prompt.max_prompt_length or max_new_tokens",
            name,
            limit,
            limit - room,
            gen.max_new_tokens,
        )
        return True

    recall(model, "positions_warned", warn)
    return replace(gen, max_new_tokens=room)


def _decode(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gen: GenerationConfig,
    eos_id: StopIds,
    pad_id: int,
    logprob_temperature: float | None = None,
    past: tuple[Any, Tensor, Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], Any, Tensor, Tensor]:
    """The decoding loop of :func:`sample`: prefill, then one token per forward; (B,) tokens per
    step, and with ``logprob_temperature`` each token's log-prob under the model's logits divided
    by it (the sampler's own log-probs: the same distribution the trainer recomputes). With
    ``past`` = (a KV cache, its columns' ids, their mask: 0 = no token there), ``prompt_ids`` are
    the tokens that follow the cached ones (a multi-turn rollout's next turn: :class:`Continuation`)
    and only they are prefilled. Also returns the cache and the ids and mask of every column before
    the generated tokens."""
    b, device = prompt_ids.shape[0], prompt_ids.device
    stop = eos_id if isinstance(eos_id, int) else torch.as_tensor(list(eos_id), device=device)
    from lit_rlhf.rollout import kv_cache

    context = prompt_mask.sum(1) + (0 if past is None else past[2].sum(1))
    gen = _within_positions(model, int(context.max()), gen, device)
    if past is None:
        ids, mask = prompt_ids, prompt_mask.long()
        cache = kv_cache.preallocated_cache(model, prompt_ids.shape[1] + gen.max_new_tokens)
    else:
        cache, past_ids, past_mask = past
        ids, mask = torch.cat([past_ids, prompt_ids], 1), torch.cat([past_mask.long(), prompt_mask.long()], 1)
        kv_cache.reserve(cache, ids.shape[1] + gen.max_new_tokens)
    width = ids.shape[1]  # the columns before the first generated token
    positions = position_ids_from_mask(mask)
    cache_kw = cache_keyword()
    out = model(
        input_ids=prompt_ids,
        attention_mask=mask,
        position_ids=positions[:, -prompt_ids.shape[1] :],
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    logits = out.logits[:, -1].float()
    next_pos = positions[:, -1:] + 1
    seen = None
    if gen.repetition_penalty != 1.0:
        seen = torch.zeros(b, logits.shape[-1], dtype=torch.bool, device=device)
        seen.scatter_(1, ids.masked_fill(mask == 0, 0), mask.bool())
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    table = _decode_mask_table(model, mask, gen.max_new_tokens)
    forward: Any = model  # None: decide at the first decoding step (layer_step_ok)
    if gen.inline_layers and table is not None and _layer_step_usable(model, cache):
        step_fn = LayerStep(model, int(next_pos.max()) + gen.max_new_tokens + 1, rows=b if gen.prepack else None)
        verdict = layer_step_verdict(model, step_fn.prepacked)
        forward = model if verdict is False else step_fn if verdict else None
    tokens, logps = [], []
    mass = logits.new_zeros(())  # Σ of every step's probabilities: finite iff they all are
    for step in range(gen.max_new_tokens):
        scores = process_logits(logits, seen, gen)
        if gen.do_sample:
            probs = scores.softmax(-1)
            mass = mass + probs.sum()
            nxt = draw(probs)
        else:
            nxt = scores.argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        if logprob_temperature is not None:
            logps.append((logits / logprob_temperature).log_softmax(-1).gather(1, nxt[:, None])[:, 0])
        finished |= is_stop(nxt, stop)
        if seen is not None:
            seen.scatter_(1, nxt[:, None], True)
        if step == gen.max_new_tokens - 1 or _all_ranks_done(bool(finished.all()), device):
            break
        if table is None:
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], 1)
        step_mask = mask if table is None else table[..., : width + step + 1]
        kwargs = {
            "input_ids": nxt[:, None],
            "attention_mask": step_mask,
            "position_ids": next_pos,
            "use_cache": True,
            cache_kw: output_cache(out),
        }
        if forward is None:
            ok, out = layer_step_ok(model, step_fn, kwargs)  # out: the model's own, for this step
            forward = step_fn if ok else model
        else:
            out = forward(**kwargs)
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    if not bool(torch.isfinite(mass)):
        raise RuntimeError(
            "sampling: the policy's next-token probabilities are not finite (NaN or inf logits): "
            "its weights or the prompts' activations have diverged"
        )
    return tokens, logps, cache, ids, mask[:, :width]


@torch.no_grad()
def sample(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gen: GenerationConfig,
    eos_id: StopIds,
    pad_id: int,
    logprob_temperature: float | None = None,
    continuation: Continuation | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Generate responses for a left-padded batch of prompts with the KV cache.

    A plain decoding loop (prefill, then one token per forward with ``cache``) instead of
    ``model.generate``: the same distribution — repetition penalty, temperature, top-k, top-p in
    transformers' order (:func:`process_logits`) — without generate's per-step machinery (where
    Python overhead dominates, on small models) and with a KV cache allocated once
    (lit_rlhf/rollout/kv_cache.py) instead of concatenated at every step (``make bench`` compares
    it with ``generate``; the README has the figures). Position ids count real tokens, so a
    left-padded prompt generates exactly as it would alone. Naive equivalent:
    ``model.generate(..., do_sample=…, temperature=…, top_k=…, top_p=…, repetition_penalty=…)``
    (tests compare greedy outputs token for token).

    Args:
        model: a ``*ForCausalLM`` (eval mode for the call, restored after).
        prompt_ids, prompt_mask: (B, P).
        eos_id: the token that ends a response, or several (EOS and a chat template's end-of-turn).
        logprob_temperature: also return the sampler's log-prob of each token under the logits
            divided by this (1 = the model's own distribution); None = not computed.
        continuation: a multi-turn rollout's cache between calls (:class:`Continuation`): rows that
            extend rows of the previous call are continued from its KV cache, only their new tokens
            prefilled; the same tokens as a full prefill, up to float rounding.
    Returns:
        response_ids (B, R) with pad after each EOS, response_mask (B, R), ended (B,); R ≤ max_new_tokens;
        the sampler's log-probs (B, R), 0 after each EOS, or None.
    """
    was_training = model.training
    model.eval()
    plan = continuation.plan(prompt_ids, prompt_mask) if continuation is not None else None
    try:
        if plan is None:
            tokens, logps, cache, ids, mask = _decode(
                model, prompt_ids, prompt_mask, gen, eos_id, pad_id, logprob_temperature
            )
        else:
            block_ids, block_mask, past = plan
            tokens, logps, cache, ids, mask = _decode(
                model, block_ids, block_mask, gen, eos_id, pad_id, logprob_temperature, past
            )
    finally:
        model.train(was_training)
    response_ids = torch.stack(tokens, 1)
    response_mask, ended = response_mask_from_eos(response_ids, eos_id)
    if continuation is not None:
        continuation.keep(cache, ids, mask, response_ids, response_mask)
    response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad_id))
    sampler_logprobs = torch.stack(logps, 1) * response_mask if logps else None
    return response_ids, response_mask, ended, sampler_logprobs


@dataclass
class Continuation:
    """The hf loop's KV cache kept from one call of :func:`sample` to the next within a multi-turn
    rollout (rollout/agent.py: each turn continues the trajectories still going, their contexts grown
    by the last turn and the environment's reply). A row whose context extends a row of the last call
    is continued from that row's cached keys and values, and only its new tokens are prefilled, instead
    of its whole context again. The cache keeps columns where a row has no token (the padding of a
    row's new tokens, the steps after a row's turn ended): the mask says which, and positions count
    the real tokens, so the logits are those of a full prefill up to float rounding. One per rollout."""

    cache: Any = None
    ids: Tensor | None = None  # (N, C) the tokens of the cache's columns
    mask: Tensor | None = None  # (N, C) 1 = a real token there
    tokens: list[list[int]] = field(default_factory=list)  # each row's real tokens in the cache, in order

    def plan(self, prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, tuple] | None:
        """(the new tokens of each row, left-padded; their mask; the past to continue from), when
        every row extends a row of the last call, in the same order; None otherwise (a full prefill)."""
        if self.cache is None:
            return None
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        keep, blocks, j = [], [], 0
        for row in rows:
            while j < len(self.tokens) and not (
                len(self.tokens[j]) < len(row) and row[: len(self.tokens[j])] == self.tokens[j]
            ):
                j += 1
            if j == len(self.tokens):
                return None
            keep.append(j)
            blocks.append(row[len(self.tokens[j]) :])
            j += 1
        from lit_rlhf.data.collate import pad as pad_rows
        from lit_rlhf.rollout import kv_cache

        index = torch.tensor(keep, device=self.mask.device)
        kv_cache.keep_rows(self.cache, index)
        block_ids, block_mask = pad_rows(blocks, 0, "left")
        device = prompt_ids.device
        return block_ids.to(device), block_mask.to(device), (self.cache, self.ids[index], self.mask[index])

    def keep(self, cache: Any, ids: Tensor, mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> None:
        """Remember the cache after a call: its columns are ``ids`` (what preceded the generated
        tokens) and every generated token but the last, which the loop never fed back."""
        from lit_rlhf.rollout import kv_cache

        if not kv_cache.continuable(cache):  # a sliding-window or other layer kind: full prefills
            self.cache, self.tokens = None, []
            return
        fed = response_ids.shape[1] - 1
        self.cache = cache
        self.ids = torch.cat([ids, response_ids[:, :fed]], 1)
        self.mask = torch.cat([mask, response_mask[:, :fed].to(mask.dtype)], 1)
        self.tokens = [row[m.bool()].tolist() for row, m in zip(self.ids.cpu(), self.mask.cpu())]
