"""Final-answer extraction shared by the verifiable rewards (docs/rewards.md §1).

:func:`extract_final_answer` reads the answer a response commits to. First the region that can
hold it (:func:`answer_region`):

- a ``<think>…</think>`` block is never read: the region starts after the last ``</think>``; a
  ``<think>`` that is never closed (the response is still reasoning, e.g. truncated) has no answer;
- the content of the last closed ``<answer>…</answer>`` in what is left, when there is one, is the
  region; otherwise the whole of what is left.

Then, in the region, the first rule that yields a non-empty answer:

1. the content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) whose braces balance (nested braces
   count, escaped ``\\{`` ``\\}`` do not; an unclosed box, e.g. in a truncated response, is skipped);
2. the rest of the line after the last ``####`` (GSM8K's marker);
3. the text after the last "the answer is" or "the final answer is" (case-insensitive), up to the
   end of that sentence (``.``, ``!`` or ``?`` followed by whitespace or the end of the text) or
   of the line; an optional ``:`` after the marker (in rule 2 too) is dropped;
4. inside ``<answer>…</answer>``: its whole content;
5. outside one: the last inline math span (``$…$``, ``$$…$$``, ``\\(…\\)``, ``\\[…\\]``) when it
   ends after the last number starts (the number is in it, or the math comes last);
6. the last number, as written (an integer, a decimal ``2.5`` or ``.5``, a fraction ``3/4``, an
   integer with thousands separators ``1,234``, ``1\\,234`` or ``1{,}234``; a leading ``-`` is its
   sign unless it follows a letter, a digit or ``)``) when it stands alone: not inside braces, not
   glued to a letter or a LaTeX command (``\\sqrt5``, ``x2``), not after ``^`` or ``_``, and not the
   last element of a bracket holding a comma or an operator (``[0,1)``, ``(3+4)``). A last number
   that does not stand alone is no answer: the response's final expression is not a number.

A span found by rules 2–4 that is a number followed by words only (``5 dollars``, ``18 apples``) is
that number; a number followed by anything with a digit or a math sign (``5 or 6``) is kept whole.
The span is then cleaned (:func:`clean_answer`). Before any rule, ``−`` (U+2212) reads as ``-``
and an escaped dollar ``\\$`` (a currency sign) is removed. No rule matches: ``None``.

Every step is one pass over the text (``str.rfind``, one regular-expression scan or one brace
count), so extraction is linear in the response's length even on degenerate, repetitive output
(``bench/run.py`` measures a 1 MB response).
"""

from __future__ import annotations

import re
from collections import deque

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"(?<!\\)[{}]")
_HASHES = re.compile(r"####")
_ANSWER_IS = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b", re.IGNORECASE)
_LINE_END = re.compile(r"\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_COLON = re.compile(r"^[ \t]*:")
# a '-' counts as a sign unless it follows a letter, digit or ')' (so "5-3" ends in 3, not -3);
# a number never starts in the middle of another one
_NUMBER = re.compile(
    r"(?:(?<![\w)])-)?(?<![\d.])"
    r"(?:(?:\d{1,3}(?:(?:,|\\,|\{,\})\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+(?:\.\d+)?)?"
)
# a number, then words only (units or prose): "5 dollars", "18 apples!", "3 because it is"
_NUMBER_THEN_WORDS = re.compile(r"(-?[\d.,/\\{}]*\d)\s+[A-Za-z][A-Za-z' ,;:!?-]*")
_MATH_DELIMITERS = (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$"))
_OPERATOR_OR_COMMA = re.compile(r"[,+\-*/^=<>]")


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


def normalize_text(text: str) -> str:
    """The response as the rules read it: ``−`` (U+2212, the Unicode minus) as ``-``, an escaped
    dollar ``\\$`` (currency, not math) removed."""
    return text.replace("\u2212", "-").replace("\\$", "")


def answer_region(text: str) -> tuple[str | None, bool]:
    """The part of a response that can hold its answer (module docstring), and whether it is an
    ``<answer>`` tag's content: after the last ``</think>``; ``None`` inside a ``<think>`` never
    closed; then the last closed ``<answer>…</answer>``'s content when there is one."""
    close = text.rfind("</think>")
    if close >= 0:
        text = text[close + len("</think>") :]
    elif "<think>" in text:
        return None, False
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return text[start + len("<answer>") : end], True
    return text, False


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` or ``\\fbox{…}`` whose braces balance (an unclosed one,
    e.g. a truncated response, is skipped for the one before it); ``None`` without one.

    One scan over the braces: each box opened is pushed with the brace depth before its ``{``; a
    ``}`` that brings the depth back to that value closes it. The last box is the closed box that
    opened last.
    """
    opens = {m.end() - 1: m.end() for m in _BOX_OPEN.finditer(text)}  # its "{" → where the content starts
    if not opens:
        return None
    depth, stack = 0, []  # stack: (depth before the box's "{", content start)
    best: tuple[int, int] | None = None
    for brace in _BRACE.finditer(text):
        at = brace.start()
        if text[at] == "{":
            if at in opens:
                stack.append((depth, opens[at]))
            depth += 1
        else:
            depth -= 1
            if stack and stack[-1][0] == depth:
                _, start = stack.pop()
                if best is None or start > best[0]:
                    best = (start, at)
    return None if best is None else text[best[0] : best[1]]


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``-3``, ``2.5``, ``3/4``, ``1,234``), or ``None``
    (whether it stands alone is :func:`extract_final_answer`'s rule 6)."""
    found = _last_match(_NUMBER, text)
    return found.group() if found else None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last match of ``pattern`` in ``text`` (one scan, nothing kept but the last)."""
    last = deque(pattern.finditer(text), maxlen=1)
    return last[0] if last else None


def _stands_alone(text: str, match: re.Match[str]) -> bool:
    """Rule 6: the number is not an argument, exponent, index or bracket element of an expression."""
    start, end = match.span()
    before = text[start - 1] if start else ""
    if before.isalpha() or before in ("^", "_", "\\") or text[end : end + 1] in ("^", "_", "{"):
        return False
    if _brace_depth(text, start) > 0:
        return False
    closer = text[end:].lstrip(" ")[:1]
    if closer in (")", "]"):
        opener = _unmatched_opener(text, start)
        if opener is not None and _OPERATOR_OR_COMMA.search(text[opener + 1 : start]):
            return False
    return True


def _brace_depth(text: str, at: int) -> int:
    """Unescaped ``{`` minus ``}`` before ``at`` (how many groups ``at`` is inside)."""
    depth = 0
    for brace in _BRACE.finditer(text, 0, at):
        depth += 1 if text[brace.start()] == "{" else -1
    return max(depth, 0)


def _unmatched_opener(text: str, at: int) -> int | None:
    """The position of the nearest ``(`` or ``[`` before ``at`` (on its line) left open there."""
    depth = 0
    for i in range(at - 1, -1, -1):
        char = text[i]
        if char == "\n":
            return None
        if char in ")]":
            depth += 1
        elif char in "([":
            if depth == 0:
                return i
            depth -= 1
    return None


def _last_math_span(text: str) -> tuple[int, str] | None:
    """(end, content) of the math span that ends last (``$$…$$``, ``\\(…\\)``, ``\\[…\\]``, ``$…$``)."""
    best: tuple[int, str] | None = None
    for left, right in _MATH_DELIMITERS:
        close = text.rfind(right)
        if close < 0:
            continue
        open_ = text.rfind(left, 0, close)
        if open_ < 0:
            continue
        if left == "$" and "$" in (text[close - 1 : close], text[open_ - 1 : open_]):
            continue  # one side of "$$…$$": that delimiter's span
        if best is None or close > best[0]:
            best = (close, text[open_ + len(left) : close])
    return best


def _number_before_words(span: str) -> str:
    """``"5 dollars"`` → ``"5"``: a number followed by words only is the number; anything else as is."""
    match = _NUMBER_THEN_WORDS.fullmatch(span)
    return match.group(1) if match and _NUMBER.fullmatch(match.group(1)) else span


def _after_last(marker: re.Pattern[str], end: re.Pattern[str], text: str) -> str | None:
    """The cleaned text between the last match of ``marker`` (and an optional ``:``) and the first
    match of ``end`` after it (or the end of the text); ``None`` without a marker."""
    found = _last_match(marker, text)
    if found is None:
        return None
    rest = text[found.end() :]
    rest = _COLON.sub("", rest, count=1)
    stop = end.search(rest)
    return clean_answer(rest[: stop.start()] if stop else rest)


def extract_final_answer(text: str) -> str | None:
    """The response's final answer by the rules of the module docstring (the region, then boxed,
    ``####``, "the answer is", the ``<answer>`` content, the last math span, the last number),
    cleaned; ``None`` when no rule yields a non-empty answer.

    >>> extract_final_answer("so x = \\\\boxed{\\\\frac{3}{4}}")
    '\\\\frac{3}{4}'
    >>> extract_final_answer("The answer is 18 apples. Done, 19 left")
    '18'
    >>> extract_final_answer("<think>maybe \\\\boxed{3}</think> <answer>5</answer>")
    '5'
    """
    region, tagged = answer_region(normalize_text(text))
    if region is None:
        return None
    boxed = last_boxed(region)
    if boxed is not None and clean_answer(boxed):
        return clean_answer(boxed)
    for marker, end in ((_HASHES, _LINE_END), (_ANSWER_IS, _SENTENCE_END)):
        span = _after_last(marker, end, region)
        if span:
            return clean_answer(_number_before_words(span))
    if tagged:
        return clean_answer(_number_before_words(clean_answer(region))) or None
    number = _last_match(_NUMBER, region)
    math = _last_math_span(region)
    if math is not None and clean_answer(math[1]) and (number is None or math[0] > number.start()):
        return clean_answer(math[1])
    if number is not None and _stands_alone(region, number):
        return number.group()
    return None


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
