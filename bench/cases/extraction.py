"""Final-answer extraction on degenerate responses (lit_rlhf.rewards.extract): the time per byte
must not grow with the response's length. A model that collapses into repeating ``\\boxed{`` or
``{`` writes responses of the longest length allowed, and the extraction runs before math-verify's
timeout, so nothing else bounds it."""

from __future__ import annotations

import time
from pathlib import Path

#: repeated to fill a response, then " 5": each stresses one rule (boxes, braces, math spans, brackets,
#: thousands groups, the "answer is" marker, an unclosed <think>)
PATTERNS = {
    "unclosed_boxes": "\\boxed{",
    "open_braces": "{",
    "dollars": "$",
    "inline_math": "\\(",
    "open_brackets": "(",
    "number_list": "1,",
    "answer_is": "the answer is ",
    "think": "<think>",
}


def _seconds(text: str, repeats: int) -> float:
    from lit_rlhf.rewards.extract import extract_final_answer

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        extract_final_answer(text)
        best = min(best, time.perf_counter() - start)
    return best


def case_extraction(models: Path, s: dict) -> dict:
    """For each pattern, the best of 3 timings at ``small`` and ``large`` bytes (1 MB; 100 kB in smoke
    mode); ``scaling`` = the largest seconds-per-byte ratio large/small over the patterns (1 when
    linear, large/small when quadratic); ``large_s`` = the slowest pattern's seconds at ``large``."""
    small, large = (10_000, 100_000) if s["steps"] == 1 else (100_000, 1_000_000)
    per_pattern = {}
    for name, piece in PATTERNS.items():
        times = []
        for size in (small, large):
            text = (piece * (size // len(piece) + 1))[:size] + " 5"
            times.append(_seconds(text, 3))
        per_pattern[name] = {
            "small_s": times[0],
            "large_s": times[1],
            "scaling": (times[1] / large) / (times[0] / small),
        }
    worst = max(per_pattern.values(), key=lambda p: p["scaling"])
    return {
        "small_bytes": small,
        "large_bytes": large,
        "patterns": per_pattern,
        "scaling": worst["scaling"],
        "large_s": max(p["large_s"] for p in per_pattern.values()),
    }
