"""A per-response ``async def`` reward, awaited concurrently over the batch (docs/remote_rewards.md).

``{_target_: lit_rlhf.rewards.PerResponse, score: mypkg.rewards.judge_one, max_concurrent: 16}``
calls ``await judge_one(prompt, response, **row_columns)`` (the row's dataset columns it accepts,
e.g. ``answer``) for every response, at most ``max_concurrent`` at a time. A call that raises or
returns something that is not a number leaves its row NaN (out of the update) and is counted in
``reward/<name>_errors``, never a silent 0; when every row of a batch fails, the function is broken,
not unlucky, and the run stops with the first error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from lit_rlhf.utils.errors import UserError


class PerResponse:
    """``await reward(prompts, responses, ended, **columns)`` → one float (NaN when its call failed)
    per response, from ``score`` (an ``async def`` or its dotted path) awaited per response."""

    def __init__(self, score: str | Callable[..., Any], max_concurrent: int = 16):
        if isinstance(score, str):
            from hydra.utils import get_object

            score = get_object(score)
        if not inspect.iscoroutinefunction(score):
            raise UserError(f"score: {getattr(score, '__qualname__', score)!r} is not an `async def` function")
        if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
            raise UserError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        self.score, self.max_concurrent = score, max_concurrent
        params = inspect.signature(score).parameters.values()
        self._any = any(p.kind is p.VAR_KEYWORD for p in params)
        self._names = {p.name for p in params}
        self.last_errors = self.last_unscored = 0
        self.last_error_example: str | None = None

    async def __call__(
        self, prompts: Sequence[Any], responses: Sequence[str], ended: Sequence[bool] | None = None, **columns: Any
    ) -> list[float]:
        semaphore = asyncio.Semaphore(self.max_concurrent)
        cols = {k: list(v) for k, v in columns.items() if self._any or k in self._names}
        failures: list[str] = []

        async def one(i: int) -> float:
            async with semaphore:
                try:
                    value = await self.score(prompts[i], responses[i], **{k: v[i] for k, v in cols.items()})
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise TypeError(f"returned {type(value).__name__}, not a number")
                    return float(value)
                except Exception as err:
                    failures.append(f"response {i}: {type(err).__name__}: {err}"[:300])
                    return math.nan

        out = list(await asyncio.gather(*(one(i) for i in range(len(responses)))))
        if responses and len(failures) == len(responses):
            raise UserError(f"{self.score.__qualname__} failed on every response of the batch, e.g. {failures[0]}")
        self.last_errors = self.last_unscored = len(failures)
        self.last_error_example = failures[0] if failures else None
        return out
