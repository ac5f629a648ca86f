"""The calling convention and error accounting of the shipped reward callables (docs/rewards.md §0).

A reward is called as ``fn(prompts, responses, ended, **columns)`` and returns one float per
response. Verifiable rewards read the ground truth from the ``answer`` column (one entry per
response, same order; ``None`` = none for that row; a list or tuple = several acceptable answers,
the response scoring its best against them); every other column is accepted and ignored.
A response whose check raises scores 0.0 and is counted, the run goes on: after each call
``last_errors`` holds the count and ``last_error_example`` the first message (``None`` without
errors), for the caller to log as ``reward/<name>_errors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class MissingAnswerError(ValueError):
    """A row that needs a ground truth has none (its ``answer`` entry is ``None``)."""


class VerifiableReward:
    """Base of the shipped rewards: the per-response loop, the ``answer`` column and the error count.

    Subclasses implement :meth:`score` (one response and its ground truth → a float) and set
    ``needs_answer`` (True: the ``answer`` column is required and a ``None`` entry is an error)
    and ``errors`` (the exception types that are counted rather than raised).
    """

    needs_answer: bool = True
    errors: tuple[type[BaseException], ...] = (Exception,)
    #: the longest ``last_error_example`` kept (a sympy message can be a whole expression)
    example_chars: int = 300

    def __init__(self) -> None:
        self.last_errors: int = 0
        self.last_error_example: str | None = None

    def score(self, response: str, truth: str | None) -> float:
        raise NotImplementedError

    def _score_against(self, response: str, truth: Any) -> float:
        """:meth:`score` against one ground truth, or the best against each of a list of them."""
        if not self.needs_answer:
            return float(self.score(response, None))
        if truth is None:
            raise MissingAnswerError("no ground truth for this row (answer is None)")
        if isinstance(truth, (list, tuple)):
            if not truth or any(t is None for t in truth):
                raise MissingAnswerError(f"a list of acceptable answers must be non-empty, without None: {truth!r}")
            return max(float(self.score(response, str(t))) for t in truth)
        return float(self.score(response, str(truth)))

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Sequence[bool] | None = None,
        answer: Sequence[Any] | None = None,
        **_: Any,
    ) -> list[float]:
        """One float per response (``prompts`` and ``ended`` are accepted and not read).

        Raises ValueError (a configuration error, not a per-response one) when the reward needs the
        ``answer`` column and it is missing or its length differs from ``responses``'.
        """
        n = len(responses)
        truths: list[Any] = [None] * n
        if self.needs_answer:
            if answer is None:
                raise ValueError(
                    f"{type(self).__name__} needs the ground truth: the caller passes the data set's "
                    "'answer' column as the keyword `answer` (one per response)"
                )
            truths = list(answer)
            if len(truths) != n:
                raise ValueError(f"{type(self).__name__}: {len(truths)} answers for {n} responses")
        scores: list[float] = []
        errors, example = 0, None
        for i, (response, truth) in enumerate(zip(responses, truths)):
            try:
                value = self._score_against(response, truth)
            except self.errors as err:
                errors += 1
                if example is None:
                    example = f"response {i}: {type(err).__name__}: {err}"[: self.example_chars]
                value = 0.0
            scores.append(value)
        self.last_errors, self.last_error_example = errors, example
        return scores
