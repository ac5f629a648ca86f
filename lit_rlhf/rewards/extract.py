"""Final-answer extraction shared by the verifiable rewards (docs/rewards.md §1).

:func:`extract_final_answer` reads the answer a response commits to, by the first rule that
yields a non-empty answer:

1. the content of the last ``\\boxed{…}`` whose braces balance (nested braces count, escaped
   ``\\{`` ``\\}`` do not; an unclosed box, e.g. in a truncated response, is skipped);
2. the rest of the line after the last ``####`` (GSM8K's marker);
3. the text after the last "the answer is" or "the final answer is" (case-insensitive), up to the
   end of that sentence (``.``, ``!`` or ``?`` followed by whitespace or the end of the text) or
   of the line; an optional ``:`` after the marker (in rule 2 too) is dropped;
4. the last number in the text, as written: an integer, a decimal ``2.5``, a fraction ``3/4``, an
   integer with thousands separators ``1,234``; a leading ``-`` is its sign unless it follows a
   letter, a digit or ``)`` (``5-3`` ends in ``3``).

The span found is then cleaned (:func:`clean_answer`). No rule matches: ``None``.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####")
_ANSWER_IS = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b", re.IGNORECASE)
_LINE_END = re.compile(r"\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_COLON = re.compile(r"^[ \t]*:")
# a '-' counts as a sign unless it follows a letter, digit or ')' (so "5-3" ends in 3, not -3);
# a number never starts in the middle of another one
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")


def clean_answer(span: str) -> str:
    """A found span without its wrapping: surrounding whitespace, then any leading/trailing ``$``
    and ``*`` (inline math, markdown bold), and a trailing ``.``, repeated until nothing changes.

    >>> clean_answer(" **$18$**. ")
    '18'
    """
    prev = None
    while prev != span:
        prev = span
        span = span.strip().strip("$*").strip()
        if span.endswith("."):
            span = span[:-1]
    return span


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` whose braces balance (an unclosed one, e.g. a
    truncated response, is skipped for the one before it); ``None`` without one."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{" and text[i - 1] != "\\":
                depth += 1
            elif text[i] == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``-3``, ``2.5``, ``3/4``, ``1,234``), or ``None``."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _after_last(marker: re.Pattern[str], end: re.Pattern[str], text: str) -> str | None:
    """The cleaned text between the last match of ``marker`` (and an optional ``:``) and the first
    match of ``end`` after it (or the end of the text); ``None`` without a marker."""
    found = list(marker.finditer(text))
    if not found:
        return None
    rest = text[found[-1].end() :]
    rest = _COLON.sub("", rest, count=1)
    stop = end.search(rest)
    return clean_answer(rest[: stop.start()] if stop else rest)


def extract_final_answer(text: str) -> str | None:
    """The response's final answer by the rules of the module docstring (boxed, ``####``,
    "the answer is", last number), cleaned; ``None`` when no rule yields a non-empty answer.

    >>> extract_final_answer("so x = \\\\boxed{\\\\frac{3}{4}}")
    '\\\\frac{3}{4}'
    >>> extract_final_answer("The answer is 18. Done, 19 left")
    '18'
    """
    boxed = last_boxed(text)
    if boxed is not None and clean_answer(boxed):
        return clean_answer(boxed)
    for marker, end in ((_HASHES, _LINE_END), (_ANSWER_IS, _SENTENCE_END)):
        span = _after_last(marker, end, text)
        if span:
            return span
    return last_number(text)


def answer_after_prefix(text: str, prefix: str) -> str | None:
    """The text after the LAST occurrence of ``prefix`` (case-insensitive) to the end of that line,
    cleaned (:func:`clean_answer`); ``None`` when ``prefix`` does not occur.

    >>> answer_after_prefix("answer: 41\\nno wait\\nAnswer: 42", "answer:")
    '42'
    """
    at = text.lower().rfind(prefix.lower())
    if at < 0:
        return None
    return clean_answer(text[at + len(prefix) :].split("\n", 1)[0])


def reference_answer(truth: str) -> str:
    """The ground truth to compare with: in GSM8K form (``"…reasoning… #### 42"``) what follows the
    last ``####``; otherwise the string itself; stripped either way."""
    head, sep, tail = truth.rpartition("####")
    return (tail if sep else truth).strip()
