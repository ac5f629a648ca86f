"""An LLM judge behind an OpenAI-compatible chat endpoint (``vllm serve``, SGLang, a hosted API;
docs/remote_rewards.md), for ``algo.reward_fn`` / ``algo.reward_fns``::

    {_target_: lit_rlhf.rewards.LLMJudge, urls: "http://judge:8000", model: Qwen/Qwen2.5-7B-Instruct,
     score_range: [0, 10], max_rpm: 600, token_env: JUDGE_API_KEY}

Each response is one ``POST <url>/v1/chat/completions`` with the ``template`` filled in
(``{prompt}``, ``{response}`` and ``{answer}``, the row's reference, are replaced; other braces are
left alone), greedy by default. The score is the last match of ``score_pattern`` in the reply,
mapped from ``score_range`` onto [0, 1]. A reply without a score, or one outside the range, leaves
its row NaN and is counted (``reward/<name>_errors``, the first reply in the log) — the judge
answered, so it is not retried. Transport failures follow :mod:`lit_rlhf.rewards.http`'s policy;
requests are spread over the endpoints and bounded by ``max_concurrent``, ``max_rpm`` and ``max_tpm``
(prompt characters / 4 + ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lit_rlhf.rewards.http import (
    CallStats,
    EndpointPool,
    Malformed,
    RemoteRewardError,
    RewardServiceDown,
    estimate_tokens,
    parse_urls,
)
from lit_rlhf.rewards.remote import prompt_text

DEFAULT_TEMPLATE = (
    "You are grading an assistant's answer.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Assistant's answer:\n{response}\n\n"
    "Rate the assistant's answer from 0 (wrong or unhelpful) to 10 (correct and helpful). "
    "End your reply with a line of the form `Score: <number>`."
)


class LLMJudge:
    """``await judge(prompts, responses, ended, **columns)`` → one score in [0, 1] (NaN when the reply
    had none, counted) per response (module docstring). After each call: ``last_errors`` /
    ``last_unscored`` (rows without a score), ``last_unparsable`` (of those, replies without a
    parsable score), ``last_error_example``, ``last_retries``, ``outage``."""

    remote = True  # the memory plan lists it with no memory (modules/rl.py: planned_models)

    def __init__(
        self,
        urls: str | Sequence[str],
        model: str,
        *,
        template: str = DEFAULT_TEMPLATE,
        system: str | None = None,
        score_pattern: str = r"[Ss]core\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)",
        score_range: Sequence[float] = (0.0, 10.0),
        max_tokens: int = 256,
        temperature: float = 0.0,
        answer_column: str = "answer",
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        give_up_after_s: float = 600.0,
        max_concurrent: int = 32,
        max_rpm: float | None = None,
        max_tpm: float | None = None,
        token_env: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ):
        if "{response}" not in template:
            raise RemoteRewardError("template: must contain {response} (and may contain {prompt} and {answer})")
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as err:
            raise RemoteRewardError(f"score_pattern: {score_pattern!r} is not a regular expression ({err})") from err
        if self.pattern.groups < 1:
            raise RemoteRewardError(f"score_pattern: {score_pattern!r} needs a group around the number")
        lo, hi = (float(v) for v in score_range)
        if not hi > lo:
            raise RemoteRewardError(f"score_range: [{lo}, {hi}] must be [low, high] with high > low")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise RemoteRewardError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.pool = EndpointPool(
            parse_urls(urls, "/v1/chat/completions"),
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            give_up_after_s=give_up_after_s,
            max_concurrent=max_concurrent,
            max_rpm=max_rpm,
            max_tpm=max_tpm,
            token_env=token_env,
            clock=clock,
            sleep=sleep,
        )
        self.model, self.template, self.system = model, template, system
        self.range, self.max_tokens, self.temperature = (lo, hi), max_tokens, float(temperature)
        self.answer_column = answer_column
        self.last_errors = self.last_unscored = self.last_unparsable = self.last_retries = 0
        self.last_error_example: str | None = None
        self.outage: str | None = None

    def __repr__(self) -> str:
        return f"LLMJudge({self.model} at {self.pool.names()})"

    def render(self, prompt: Any, response: str, answer: Any) -> str:
        text = self.template.replace("{prompt}", prompt_text(prompt)).replace(
            "{answer}", "" if answer is None else str(answer)
        )
        return text.replace("{response}", response)

    def parse(self, reply: str) -> float | None:
        """The reply's last score, mapped onto [0, 1]; None when it has none in ``score_range``."""
        found = self.pattern.findall(reply)
        if not found:
            return None
        last = found[-1] if isinstance(found[-1], str) else found[-1][0]
        try:
            value = float(last)
        except ValueError:
            return None
        lo, hi = self.range
        return (value - lo) / (hi - lo) if lo <= value <= hi else None

    async def __call__(
        self, prompts: Sequence[Any], responses: Sequence[str], ended: Sequence[bool] | None = None, **columns: Any
    ) -> list[float]:
        n = len(responses)
        answers = list(columns.get(self.answer_column) or [None] * n)
        stats = CallStats()
        async with self.pool.session() as session:
            state = self.pool.call_state()
            replies = await asyncio.gather(
                *(
                    self._ask(session, i, self.render(prompts[i], responses[i], answers[i]), state, stats)
                    for i in range(n)
                )
            )
        scores, unparsable, example = [], 0, stats.example
        for i, reply in enumerate(replies):
            value = self.parse(reply) if reply is not None else None
            if reply is not None and value is None:
                unparsable += 1
                example = example or f"reply {i} has no score in {list(self.range)}: {reply[:200]!r}"
            scores.append(math.nan if value is None else value)
        self.last_errors = self.last_unscored = sum(1 for s in scores if math.isnan(s))
        self.last_unparsable, self.last_error_example = unparsable, example
        self.last_retries, self.outage = stats.retries, stats.outage
        return scores

    async def _ask(self, session: Any, i: int, content: str, state: Any, stats: CallStats) -> str | None:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": content}
        ]
        payload = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

        def check(body: Any) -> str:
            try:
                reply = body["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError) as err:
                raise Malformed(f"not a chat completion (no choices[0].message.content: {err!r})") from err
            if not isinstance(reply, str):
                raise Malformed(f"choices[0].message.content is {type(reply).__name__}, not text")
            return reply

        try:
            return await self.pool.post(
                session,
                payload,
                prefer=i % len(self.pool.endpoints),
                tokens=estimate_tokens([content]) + self.max_tokens,
                check=check,
                state=state,
                stats=stats,
            )
        except RewardServiceDown as err:
            stats.outage = stats.outage or str(err)
            stats.example = stats.example or str(err)
            return None
