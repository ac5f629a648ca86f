"""String-level rewards: the response's format (a regular expression) and the exact match of its
final answer (docs/rewards.md §3, §4). Neither needs math-verify."""

from __future__ import annotations

import re

from lit_rlhf.rewards.base import VerifiableReward
from lit_rlhf.rewards.extract import answer_after_prefix, extract_final_answer, reference_answer
from lit_rlhf.utils.config import ConfigError

#: DeepSeek-R1's format: the reasoning in <think>…</think>, then the answer in <answer>…</answer>
DEFAULT_FORMAT = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


class FormatReward(VerifiableReward):
    """1.0 when the whole response, stripped of surrounding whitespace, matches ``pattern``
    (``re.fullmatch`` with ``re.DOTALL``: ``.`` spans lines), else 0.0. Reads no ground truth."""

    needs_answer = False

    def __init__(self, pattern: str = DEFAULT_FORMAT):
        super().__init__()
        if not isinstance(pattern, str):
            raise ConfigError("pattern", f"must be a regular expression string, got {pattern!r}")
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError("pattern", f"is not a valid regular expression ({err}): {pattern!r}") from err

    def score(self, response: str, truth: str | None) -> float:
        return 1.0 if self.regex.fullmatch(response.strip()) else 0.0


NORMALIZERS = {"strip": lambda s: s.strip(), "casefold": lambda s: s.strip().casefold()}
"""``exact_match``'s ``normalize`` options: applied to both the answer and the ground truth."""


class ExactMatch(VerifiableReward):
    """1.0 when the response's final answer equals the ground truth as strings after normalization, else 0.0.

    The rule, per response:

    1. answer = with ``answer_prefix`` unset,
       :func:`~lit_rlhf.rewards.extract.extract_final_answer` (last ``\\boxed{…}``, then ``#### …``,
       then "the answer is …", then the last number); with ``answer_prefix`` set (e.g. ``"answer:"``),
       only :func:`~lit_rlhf.rewards.extract.answer_after_prefix`: the text after the prefix's LAST
       occurrence (case-insensitive) to the end of that line; both clean the answer (surrounding
       whitespace, ``$``, ``*``, a trailing ``.``); none found → 0.0;
    2. truth = the ground truth, reduced to what follows its last ``####`` (GSM8K form);
    3. 1.0 if ``normalize(answer) == normalize(truth)``: ``"strip"`` strips surrounding whitespace,
       ``"casefold"`` also case-folds. No other equivalence: ``1,234`` ≠ ``1234``, ``0.5`` ≠ ``1/2``.

    A ``None`` ground truth is counted as an error (score 0.0).
    """

    def __init__(self, normalize: str = "strip", answer_prefix: str | None = None):
        super().__init__()
        if normalize not in NORMALIZERS:
            raise ConfigError("normalize", f"must be one of {sorted(NORMALIZERS)}, got {normalize!r}")
        if answer_prefix is not None and (not isinstance(answer_prefix, str) or not answer_prefix.strip()):
            raise ConfigError(
                "answer_prefix", f"must be a non-empty string (e.g. 'answer:') or None, got {answer_prefix!r}"
            )
        self.normalize = NORMALIZERS[normalize]
        self.answer_prefix = answer_prefix

    def score(self, response: str, truth: str | None) -> float:
        if self.answer_prefix is None:
            answer = extract_final_answer(response)
        else:
            answer = answer_after_prefix(response, self.answer_prefix)
        if answer is None:
            return 0.0
        return 1.0 if self.normalize(answer) == self.normalize(reference_answer(truth or "")) else 0.0


def format_reward(pattern: str = DEFAULT_FORMAT) -> FormatReward:
    """The format reward (:class:`FormatReward`): 1.0 when the stripped response fully matches
    ``pattern`` (``re.DOTALL``), else 0.0 (docs/rewards.md §3).

    Args:
        pattern: the regular expression; the default is DeepSeek-R1's
            ``<think>…</think> <answer>…</answer>`` layout.
    Raises:
        ConfigError: ``pattern`` does not compile (the error names the key ``pattern``).
    """
    return FormatReward(pattern=pattern)


def exact_match(normalize: str = "strip", answer_prefix: str | None = None) -> ExactMatch:
    """The exact-match reward (:class:`ExactMatch`): 1.0 when the response's final answer equals the
    ``answer`` column's ground truth as normalized strings, else 0.0 (docs/rewards.md §4).

    Args:
        normalize: ``"strip"`` (surrounding whitespace) or ``"casefold"`` (that, and case-folding).
        answer_prefix: when set (e.g. ``"answer:"``), the answer is the text after its last
            occurrence, to the end of that line, and no other rule applies.
    Raises:
        ConfigError: a bad ``normalize`` or ``answer_prefix``.
    """
    return ExactMatch(normalize=normalize, answer_prefix=answer_prefix)
