"""Math accuracy: the response's final answer is equivalent to the ground truth, checked with
math-verify (docs/rewards.md §2; the rule-based accuracy reward of DeepSeek-R1, DAPO, Dr. GRPO).

math-verify (Hugging Face, ``pip install 'lit_rlhf[verify]'``) bounds each parse and comparison
with ``signal.alarm``, which works only in the main thread: there its timeout applies, anywhere
else it is switched off (``None``), so a call from a worker thread runs without one.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from lit_rlhf.rewards.base import VerifiableReward
from lit_rlhf.rewards.extract import clean_answer, extract_final_answer, reference_answer
from lit_rlhf.utils.config import ConfigError


class GroundTruthParseError(ValueError):
    """math-verify finds no expression in a ground truth."""


_LETTERS = re.compile(r"[A-Za-z' -]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_PERCENT = re.compile(r"\s*(?:\\%|%|\\text\{\s*\\?%\s*\}|\\?percent)\s*$")
_THOUSANDS = re.compile(r"(?<=\d)(?:\\,|\{,\}|\\!|\\ )(?=\d{3}(?!\d))")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")
_SPACE = re.compile(r"\s+")


def math_text(text: str) -> str:
    """An answer or ground truth as math_accuracy compares it: a trailing percent sign (``%``,
    ``\\%``, ``\\text{%}``, ``percent``) dropped, LaTeX thousands spacing (``1\\,000``,
    ``1{,}000``) written ``1,000``, ``−`` (U+2212) as ``-``.

    >>> math_text("1\\,000\\%")
    '1,000'
    """
    text = text.replace("\u2212", "-")
    text = _THOUSANDS.sub(",", text)
    return _PERCENT.sub("", text).strip()


def is_words(text: str) -> bool:
    """A ground truth of words (letters, spaces, ``'`` and ``-`` only, with a word of two letters
    or more: ``forty two``, ``Paris``, ``no solution``), which math_accuracy compares as text; a
    single letter (``B``, ``x``) stays a symbol."""
    return _LETTERS.fullmatch(text) is not None and _WORD.search(text) is not None


def _as_words(text: str) -> str:
    """Text to compare a words ground truth with: ``\\text{…}`` unwrapped, case-folded, spaces collapsed."""
    return _SPACE.sub(" ", _TEXT.sub(r"\1", text)).strip().casefold()


def _import_math_verify() -> Any:
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as err:
        raise ImportError(
            "lit_rlhf.rewards.math_accuracy needs math-verify: pip install 'lit_rlhf[verify]' "
            "(or `make install`, which installs that extra)"
        ) from err
    return math_verify, TimeoutException


class MathAccuracy(VerifiableReward):
    """1.0 when the response's final answer is mathematically equivalent to the ground truth, else 0.0.

    The rule, per response (docs/rewards.md §2 has the conventions with examples):

    1. answer = :func:`~lit_rlhf.rewards.extract.extract_final_answer` (the region after
       ``</think>`` and inside ``<answer>…</answer>``, then the last ``\\boxed{…}``, ``#### …``,
       "the answer is …", the last math span or standalone number); none found → 0.0;
    2. truth = the ground truth, reduced to what follows its last ``####`` (GSM8K form), cleaned
       like an answer (surrounding ``$``, ``*``, trailing ``.``); a list or tuple of ground truths is
       several acceptable answers (1.0 when any matches, :class:`~lit_rlhf.rewards.base.VerifiableReward`);
    3. both are normalised (:func:`math_text`): a percent is its number (``28\\%``, ``28%``,
       ``28 percent`` and ``28`` are one answer; ``0.28`` is another), ``1\\,000`` and ``1{,}000``
       are ``1,000``, the Unicode minus is ``-``;
    4. the same text on both sides (ignoring whitespace) → 1.0, before any parse (``12:00``, which
       sympy cannot read, equals ``12:00``);
    5. a ground truth of words (:func:`is_words`: ``forty two``, ``Paris``) is compared as text,
       case-insensitively, with ``\\text{…}`` removed from the answer — math-verify would read it
       as a product of symbols, so that ``two forty`` equalled ``forty two``;
    6. otherwise both are parsed by ``math_verify.parse`` as ``\\boxed{<text>}`` (so bare LaTeX,
       plain numbers, ``3/4``, ``1,234`` and ``x = 3`` all parse); an answer that does not parse →
       0.0; a ground truth that does not parse is an error (counted); 1.0 if
       ``math_verify.verify(truth, answer)`` (sympy equivalence: ``\\frac{1}{2}`` = ``0.5`` =
       ``1/2``; ``1,000`` = ``1000``; ``x = 3`` = ``3``), else 0.0.

    Counted errors (score 0.0, ``last_errors``): a ``None`` ground truth, an unparseable ground
    truth, a math-verify exception or timeout. ``ended`` is not read (truncation is not a wrong
    answer here; see DAPO's overlong shaping for that).
    """

    def __init__(self, timeout_seconds: int | None = 5):
        super().__init__()
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int) or timeout_seconds < 1
        ):
            raise ConfigError(
                "timeout_seconds",
                f"must be a whole number of seconds >= 1 (signal.alarm's unit) or "
                f"None for no timeout, got {timeout_seconds!r}",
            )
        self.timeout_seconds = timeout_seconds
        self._mv, timeout_error = _import_math_verify()
        self.errors = (Exception, timeout_error)
        self._truths: dict[tuple[str, int | None], Any] = {}

    def _timeout(self) -> int | None:
        """math-verify's timeout for this thread: ``timeout_seconds`` in the main thread, else None."""
        return self.timeout_seconds if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str, timeout: int | None) -> list:
        return self._mv.parse("\\boxed{" + text + "}", parsing_timeout=timeout, raise_on_error=True)

    def _parse_truth(self, text: str, timeout: int | None) -> Any:
        """The ground truth's normalised text (:func:`math_text`) parsed, kept per (text, timeout)."""
        key = (text, timeout)
        if key not in self._truths:
            parsed = self._parse(text, timeout) if text else []
            if not parsed:
                raise GroundTruthParseError(f"math-verify finds no expression in the ground truth {text!r}")
            if len(self._truths) >= 4096:  # a GRPO group repeats its truth; older truths are not asked again
                self._truths.clear()
            self._truths[key] = parsed
        return self._truths[key]

    def score(self, response: str, truth: str | None) -> float:
        answer = extract_final_answer(response)
        gold_text = math_text(clean_answer(reference_answer(truth or "")))
        if is_words(gold_text):
            return 1.0 if answer is not None and _as_words(answer) == gold_text.casefold() else 0.0
        timeout = self._timeout()
        gold = self._parse_truth(gold_text, timeout)
        if answer is None:
            return 0.0
        answer = math_text(answer)
        if _SPACE.sub("", answer) == _SPACE.sub("", gold_text):
            return 1.0
        parsed = self._parse(answer, timeout) if answer else []
        if not parsed:
            return 0.0
        return 1.0 if self._mv.verify(gold, parsed, timeout_seconds=timeout, raise_on_error=True) else 0.0


def math_accuracy(timeout_seconds: int | None = 5) -> MathAccuracy:
    """The math accuracy reward (:class:`MathAccuracy`): 1.0 when the response's final answer equals
    the ``answer`` column's ground truth by math-verify, else 0.0 (docs/rewards.md §2).

    Args:
        timeout_seconds: math-verify's limit on each parse and each comparison, in whole seconds,
            applied in the main thread only (signal.alarm); ``None``: no limit anywhere.
    Raises:
        ImportError: math-verify is not installed (``pip install 'lit_rlhf[verify]'``).
        ConfigError: a bad ``timeout_seconds``.
    """
    return MathAccuracy(timeout_seconds=timeout_seconds)
