"""From prompts to a scored :class:`~lit_rlhf.core.types.Rollout`: the ONE rollout path.

PPO's training iterations, every RL stage's validation and the demo's final evaluation call
:func:`generate_and_score` (docs/architecture.md "One rollout path"). It samples responses with
the rollout engine (the hf KV-cache loop, or a colocated vLLM engine), decodes them, and runs one
forward per model it is given, in the caller's grad mode (``torch.inference_mode`` in PPO's
rollout, docs/algorithms.md §2.1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.types import Rollout
from lit_rlhf.data.chat import end_of_turn_ids, has_chat_template
from lit_rlhf.rollout.forward import response_logprobs, response_values
from lit_rlhf.rollout.generate import Continuation, GenerationConfig, sample
from lit_rlhf.utils.facts import recall

log = logging.getLogger(__name__)
Scorer = Any  # lit_rlhf/rollout/scorers.py: scorer.submit(ids, mask, prompts, responses, ended, columns=…)() -> (B,)


def repeat_prompts(batch: Mapping[str, Any], times: int) -> dict[str, Any]:
    """``batch`` with every prompt (its ids, mask, text and columns) repeated ``times`` times in a
    row: a group of responses to one prompt (GRPO's G, pass@k's k) is consecutive rows."""
    return {
        "prompt_ids": batch["prompt_ids"].repeat_interleave(times, 0),
        "prompt_mask": batch["prompt_mask"].repeat_interleave(times, 0),
        "prompts": [p for p in batch["prompts"] for _ in range(times)],
        "columns": {k: [x for x in v for _ in range(times)] for k, v in (batch.get("columns") or {}).items()},
    }


def stop_token_ids(tokenizer: Any) -> int | list[int]:
    """The ids that end a response: EOS, and when the tokenizer has a chat template the token(s) it
    closes an assistant turn with (data/chat.py: ``end_of_turn_ids``; ``<|im_end|>``, ``<|eot_id|>``).
    Found once per tokenizer (kept on it: lit_rlhf/utils/facts.py)."""
    return recall(tokenizer, "stop_ids", lambda: _find_stop_ids(tokenizer))


def _find_stop_ids(tokenizer: Any) -> int | list[int]:
    eos, ids = tokenizer.eos_token_id, None
    if has_chat_template(tokenizer):
        try:
            ids = [eos, *(i for i in end_of_turn_ids(tokenizer) if i != eos)]
        except Exception as err:
            log.warning(
                "the chat template's end-of-turn token could not be found (%s); responses stop at EOS only", err
            )
    return ids if ids and len(ids) > 1 else eos


def decode_responses(tokenizer: Any, response_ids: Tensor, response_mask: Tensor, ended: Tensor) -> list[str]:
    """Response texts without their final EOS. Other special tokens stay visible: a policy that
    emits ``<bos>`` mid-text must not be scored as fluent text."""
    out = []
    for ids, n, e in zip(response_ids.tolist(), response_mask.sum(-1).tolist(), ended.tolist()):
        out.append(tokenizer.decode(ids[: n - 1 if e else n], skip_special_tokens=False).strip())
    return out


def _eval_forward(model: Any, fn: Callable[[], Tensor]) -> Tensor:
    """``fn()`` with ``model`` in eval mode (no dropout), its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        return fn()
    finally:
        model.train(was_training)


def sample_responses(
    policy: Any,
    batch: Mapping[str, Any],
    tokenizer: Any,
    gen: GenerationConfig,
    engine: Any,
    n: int,
    logprob_temperature: float | None,
    agent: Any = None,
) -> tuple[Mapping[str, Any], tuple, Any]:
    """(``batch`` with each prompt repeated ``n`` times, the ``sample`` tuple of its responses, the
    multi-turn result or None): ``n`` responses per prompt from the vllm ``engine`` (one request
    each) or, with None, the hf loop over ``policy`` on the repeated prompts (its draws exactly as
    before groups were requests). With an ``agent`` (rollout/agent.py) each response is a whole
    trajectory, the engine continuing every active one per turn; its prompts are re-rendered with
    the environment's tools."""
    stop, pad = stop_token_ids(tokenizer), tokenizer.pad_token_id
    # the hf loop keeps each trajectory's KV cache between the turns of a multi-turn rollout
    continuation = Continuation() if agent is not None and engine is None else None

    def draw(ids: Tensor, mask: Tensor, g: GenerationConfig, times: int = 1, budgets: list[int] | None = None) -> tuple:
        if engine is not None:
            return engine.sample(ids, mask, g, stop, pad, logprob_temperature, n=times, budgets=budgets)
        # a row past its own budget is cut after
        return sample(policy, ids, mask, g, stop, pad, logprob_temperature, continuation)

    if agent is not None:
        batch = repeat_prompts(batch, n) if n > 1 else batch
        turns = agent.run(draw, batch, tokenizer, gen, pad)
        batch = {**batch, "prompt_ids": turns.prompt_ids, "prompt_mask": turns.prompt_mask}
        sampled = (turns.response_ids, turns.response_mask, turns.ended, turns.sampler_logprobs)
        return batch, sampled, turns
    if engine is not None:
        sampled = draw(batch["prompt_ids"], batch["prompt_mask"], gen, n)
    if n > 1:
        batch = repeat_prompts(batch, n)
    if engine is None:
        sampled = draw(batch["prompt_ids"], batch["prompt_mask"], gen)
    return batch, sampled, None


def rollout_inputs(drawn: tuple) -> tuple[Tensor, Tensor, int]:
    """(ids, attention mask, prompt width) of the sequences of :func:`sample_responses`' output: the
    prompts and responses side by side (a multi-turn trajectory's environment tokens attended)."""
    batch, sampled, turns = drawn
    attention = turns.attention_mask if turns is not None else sampled[1]
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    return torch.cat([prompt_ids, sampled[0]], 1), torch.cat([prompt_mask, attention], 1), prompt_ids.shape[1]


def scored_logprobs(model: Any, inputs: tuple, logprob_temperature: float, padding_free: bool) -> Tensor:
    """``model``'s log-probs (eval mode, the caller's grad mode) of the responses of ``inputs``
    (:func:`rollout_inputs`)."""
    ids, mask, width = inputs
    return _eval_forward(
        model, lambda: response_logprobs(model, ids, mask, width, logprob_temperature, padding_free=padding_free)[0]
    )


def generate_and_score(
    policy: Any,
    batch: Mapping[str, Any],
    tokenizer: Any,
    gen: GenerationConfig,
    *,
    reference: Any = None,
    critic: Any = None,
    scorer: Scorer | None = None,
    policy_logprobs: bool = True,
    logprob_temperature: float = 1.0,
    padding_free: bool = False,
    sampler_logprobs: bool = False,
    engine: Any = None,
    responses_per_prompt: int = 1,
    agent: Any = None,
    drawn: tuple | None = None,
    ref_logprobs: Tensor | None = None,
) -> Rollout:
    """Sample ``responses_per_prompt`` responses per prompt and score them with each model given.

    Args:
        policy: the ``*ForCausalLM`` that samples (and, with ``policy_logprobs``, is scored).
        batch: ``prompt_ids`` (B, P) left-padded, ``prompt_mask`` (B, P), ``prompts`` (B raw strings),
            optionally ``columns`` (name → B values: the rows' ground truth, handed to the scorer and
            kept in the rollout).
        tokenizer: the policy's tokenizer (EOS/pad ids, decoding).
        gen: sampling settings.
        reference: frozen reference → ``ref_logprobs``; critic → ``values``; scorer → ``scores``
            (a :class:`~lit_rlhf.rollout.scorers.ModelScorer` or ``CallableScorer``); None = not computed.
        policy_logprobs: False leaves ``logprobs`` to the caller (PPO's fused first forward).
        logprob_temperature: divide logits by this before the log-softmax (1.0 = the model's own).
        padding_free: score with packed forwards (docs/architecture.md "Padding-free forwards").
        sampler_logprobs: keep the sampler's own log-probs of its tokens (``Rollout.sampler_logprobs``,
            at ``logprob_temperature``): the other side of the sampler–trainer mismatch
            (docs/algorithms.md §2.10).
        engine: None = the hf loop over ``policy``, or a synced :class:`~lit_rlhf.rollout.vllm_engine.VLLMEngine`.
        responses_per_prompt: G responses per prompt (GRPO, pass@k), consecutive rows (vllm: one ``n=G`` request).
        agent: a :class:`~lit_rlhf.rollout.agent.AgentLoop`: each response is a multi-turn trajectory
            with an environment (``response_attention_mask`` holds its tokens, ``response_mask`` the
            policy's; the columns ``env_reward``, ``tool_calls`` and ``turns`` are added); None = one turn.
        drawn: the responses already sampled, :func:`sample_responses`' output for ``batch`` (an
            asynchronous producer's, rollout/producer.py); None = sampled here.
        ref_logprobs: the reference's log-probs of ``drawn``'s first rows, computed where it was
            sampled (the producer holds the frozen reference); the other rows, or all with None,
            are scored here when ``reference`` is given (each row's log-probs do not depend on the
            rows scored with it).
    Returns:
        the :class:`Rollout`; fields of models not given are None, ``rewards``/``advantages``/``returns`` too.
    """
    lt = logprob_temperature if sampler_logprobs else None
    if drawn is None:
        drawn = sample_responses(policy, batch, tokenizer, gen, engine, responses_per_prompt, lt, agent)
    batch, sampled, turns = drawn
    response_ids, response_mask, ended, sampled_logprobs = sampled
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    ids, mask, width = inputs = rollout_inputs(drawn)

    def logprobs_of(model: Any) -> Tensor:
        return scored_logprobs(model, inputs, logprob_temperature, padding_free)

    texts = turns.texts if turns is not None else decode_responses(tokenizer, response_ids, response_mask, ended)
    prompts = list(batch["prompts"])
    columns = {k: list(v) for k, v in (batch.get("columns") or {}).items()}
    if turns is not None:  # what reward callables may read of a trajectory besides its text
        columns.update(env_reward=list(turns.env_reward), tool_calls=list(turns.tool_calls), turns=list(turns.turns))
    # scoring starts first: a remote or async reward is in flight while the forwards below run
    scores = scorer.submit(ids, mask, prompts, texts, ended, columns=columns) if scorer is not None else None
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        response_attention_mask=turns.attention_mask if turns is not None else None,
        ended=ended,
        logprobs=logprobs_of(policy) if policy_logprobs else None,
        ref_logprobs=_completed(ref_logprobs, reference, inputs, logprob_temperature, padding_free),
        sampler_logprobs=sampled_logprobs,
        values=_eval_forward(critic, lambda: response_values(critic, ids, mask, width)) if critic is not None else None,
        scores=scores() if scores is not None else None,
        prompts_text=prompts,
        responses_text=texts,
        columns=columns,
    )


def _completed(
    ref_logprobs: Tensor | None, reference: Any, inputs: tuple, logprob_temperature: float, padding_free: bool
) -> Tensor | None:
    """The reference's log-probs of every row of ``inputs``: ``ref_logprobs`` (those of the first
    rows, scored elsewhere; None: none) and the others' scored with ``reference`` (None: not computed)."""
    ids, mask, width = inputs
    done = ref_logprobs.shape[0] if ref_logprobs is not None else 0
    if reference is None or done == ids.shape[0]:
        return ref_logprobs
    rest = scored_logprobs(reference, (ids[done:], mask[done:], width), logprob_temperature, padding_free)
    return rest if ref_logprobs is None else torch.cat([ref_logprobs, rest], 0)
