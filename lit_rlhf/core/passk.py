"""pass@k and mean@k from n sampled answers per problem (docs/rewards.md §5; Chen et al. 2021,
"Evaluating Large Language Models Trained on Code", §2.1).

pass@k is the probability that at least one of k answers drawn without replacement from the n
sampled (c of them correct) is correct: 1 − C(n−c, k) / C(n, k), the unbiased estimator of the
Codex paper. Pure Python (``math`` only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"pass@k: {name} must be an integer >= {low}, got {value!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k) / C(n, k): the chance that k of the n samples (c correct), drawn without
    replacement, hold at least one correct one.

    Computed as the Codex paper does, without large binomials:
    C(n−c, k) / C(n, k) = ∏_{i=n−c+1}^{n} (1 − k / i), and 1.0 when n − c < k (every k-subset
    holds a correct sample).

    Raises ValueError unless n ≥ 1, 0 ≤ c ≤ n and 1 ≤ k ≤ n (integers).

    >>> pass_at_k(5, 2, 2)  # 1 − C(3, 2) / C(5, 2) = 1 − 3/10
    0.7
    """
    _check_int("n", n, 1)
    _check_int("c", c, 0)
    _check_int("k", k, 1)
    if c > n:
        raise ValueError(f"pass@k: c (correct samples) must be <= n (samples), got c={c}, n={n}")
    if k > n:
        raise ValueError(f"pass@k: k must be <= n (the samples drawn per problem), got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _rows(correct: Sequence[Sequence[bool]]) -> list[list[bool]]:
    rows = [list(r) for r in correct]
    if not rows:
        raise ValueError("pass@k: no problems (an empty list of per-problem results)")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"pass@k: problem {i} has no samples")
    return rows


def pass_at_k_batch(correct: Sequence[Sequence[bool]], k: int) -> float:
    """The mean over problems of :func:`pass_at_k` (n = that problem's samples, c = its correct ones).

    ``correct[p][j]``: whether sample j of problem p is correct; problems may have different n,
    each at least k. Raises ValueError on an empty batch, a problem without samples, or k > n.
    """
    rows = _rows(correct)
    return sum(pass_at_k(len(r), sum(bool(x) for x in r), k) for r in rows) / len(rows)


def mean_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """mean@k: the expected fraction of correct answers among k samples, averaged over problems,
    i.e. the mean over problems of c / n (the same for every k ≤ n, hence no k argument)."""
    rows = _rows(correct)
    return sum(sum(bool(x) for x in r) / len(r) for r in rows) / len(rows)
