"""A reward model behind HTTP (docs/remote_rewards.md): ``algo.reward_fn`` or an ``algo.reward_fns``
component that scores the batch on one or several servers speaking OpenRLHF's contract —
``lit_rlhf.serve`` (this package's server), OpenRLHF's ``serve_rm``, or a user's own::

    POST <url>   {"query": [prompt + response, …], "prompts": [...], "responses": [...], "labels": [...]}
    → 200        {"rewards": [one number per query, same order], …}

(``responses`` is this package's addition: servers that re-tokenize with a chat template read the
prompt and the response apart; OpenRLHF's servers ignore it.) The batch is split into chunks
(``batch_size`` rows, default: one chunk per endpoint), chunk *i* goes to endpoint *i* mod *n*,
and the chunks are in flight concurrently (at most ``max_concurrent``); the scores come back in
the batch's order whatever order the answers arrive in. Retries, the failure policy and the rate
limits are :mod:`lit_rlhf.rewards.http`'s.

A chunk that cannot be scored after its retries leaves its rows NaN: they are excluded from their
group's advantage and the update, and counted (``reward/<name>_errors``, with the first failure in
the log) — never a silent 0. When every endpoint stays down for ``give_up_after_s`` the call
returns NaN for the rows it could not score and sets :attr:`RemoteReward.outage`; the RL stage
checkpoints and stops (lit_rlhf/modules/rl.py), and ``ckpt_path=last`` resumes once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
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
    numbers,
    parse_urls,
)

log = logging.getLogger(__name__)


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string as it is; a conversation (a list of ``{role, content}``) as its
    contents one per line."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


class RemoteReward:
    """``{_target_: lit_rlhf.rewards.RemoteReward, urls: "http://rm1:5000,http://rm2:5000"}`` in
    ``algo.reward_fn`` or ``algo.reward_fns`` (``clock``/``sleep`` are for tests).

    ``await reward(prompts, responses, ended, **columns)`` → one float (or NaN, counted) per
    response, scored by the servers at ``urls`` (module docstring). After each call:
    ``last_errors`` (rows left unscored), ``last_error_example`` (the first failure),
    ``last_unscored`` (= ``last_errors``: those rows are NaN, excused by the health check),
    ``last_retries`` and ``outage`` (None, or why every endpoint counts as down)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        give_up_after_s: float = 600.0,
        max_concurrent: int = 8,
        batch_size: int | None = None,
        max_rpm: float | None = None,
        max_tpm: float | None = None,
        token_env: str | None = None,
        score_key: str = "rewards",
        label_column: str = "answer",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ):
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
            raise RemoteRewardError(f"batch_size must be an integer >= 1 or null, got {batch_size!r}")
        self.pool = EndpointPool(
            parse_urls(urls, "/get_reward"),
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
        self.batch_size, self.score_key, self.label_column = batch_size, score_key, label_column
        self.last_errors = self.last_unscored = self.last_retries = 0
        self.last_error_example: str | None = None
        self.outage: str | None = None

    remote = True  # the memory plan lists it with no memory (modules/rl.py: planned_models)

    def __repr__(self) -> str:
        return f"RemoteReward({self.pool.names()})"

    def chunks(self, n: int) -> list[range]:
        size = self.batch_size or max(1, math.ceil(n / len(self.pool.endpoints)))
        return [range(i, min(n, i + size)) for i in range(0, n, size)]

    async def __call__(
        self, prompts: Sequence[Any], responses: Sequence[str], ended: Sequence[bool] | None = None, **columns: Any
    ) -> list[float]:
        n = len(responses)
        labels = list(columns[self.label_column]) if self.label_column in columns else [None] * n
        query = [prompt_text(p) + r for p, r in zip(prompts, responses)]
        stats, scores = CallStats(), [math.nan] * n
        chunks = self.chunks(n)
        async with self.pool.session() as session:
            state = self.pool.call_state()
            results = await asyncio.gather(
                *(
                    self._chunk(session, k, rows, query, prompts, responses, labels, state, stats)
                    for k, rows in enumerate(chunks)
                )
            )
        for rows, values in zip(chunks, results):
            if values is not None:
                for i, v in zip(rows, values):
                    scores[i] = v
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad and stats.example is None:
            stats.example = f"the server returned a non-finite score for response {bad[0]}"
        self.last_errors = self.last_unscored = len(bad)
        self.last_error_example, self.last_retries, self.outage = stats.example, stats.retries, stats.outage
        if stats.retries:
            log.info("remote reward: %d retried requests (first: %s)", stats.retries, stats.problems[0])
        return scores

    async def _chunk(
        self,
        session: Any,
        k: int,
        rows: range,
        query: list[str],
        prompts: Sequence[Any],
        responses: Sequence[str],
        labels: list[Any],
        state: Any,
        stats: CallStats,
    ) -> list[float] | None:
        payload = {
            "query": [query[i] for i in rows],
            "prompts": [prompts[i] for i in rows],
            "responses": [responses[i] for i in rows],
            "labels": [labels[i] for i in rows],
        }
        n = len(rows)

        def check(body: Any) -> list[float]:
            values = body.get(self.score_key) if isinstance(body, dict) else body
            if values is None:
                raise Malformed(f"no {self.score_key!r} in the answer")
            return numbers(values, n, self.score_key)

        try:
            return await self.pool.post(
                session,
                payload,
                prefer=k % len(self.pool.endpoints),
                tokens=estimate_tokens(payload["query"]),
                check=check,
                state=state,
                stats=stats,
            )
        except RewardServiceDown as err:
            stats.outage = stats.outage or str(err)
            stats.example = stats.example or str(err)
            return None
