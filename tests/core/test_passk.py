"""pass@k (Chen et al. 2021) against hand-computed values and a brute-force count over all k-subsets."""

from __future__ import annotations

import itertools
import math

import pytest

from lit_rlhf.core.passk import mean_at_k, pass_at_k, pass_at_k_batch


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 − C(3,2)/C(5,2) = 1 − 3/10
        (5, 2, 1, 0.4),  # k = 1: c/n
        (10, 3, 1, 0.3),
        (4, 1, 2, 0.5),  # 1 − C(3,2)/C(4,2) = 1 − 3/6
        (6, 1, 3, 0.5),  # 1 − C(5,3)/C(6,3) = 1 − 10/20
        (10, 2, 5, 1 - 56 / 252),  # 1 − C(8,5)/C(10,5)
        (5, 0, 3, 0.0),  # nothing correct
        (5, 5, 3, 1.0),  # everything correct
        (5, 3, 3, 1.0),  # n − c = 2 < k: every 3-subset holds a correct one
        (3, 1, 3, 1.0),  # k = n: pass iff any correct
        (3, 0, 3, 0.0),
    ],
)
def test_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def brute_force(correct: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_matches_brute_force_over_all_subsets_for_small_n():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(correct, k), abs=1e-12), (n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_large_n_is_stable_where_the_binomials_are_huge():
    # C(1000, 500) has ~300 digits: the product form needs none of it
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(1000, 10, 1) == pytest.approx(0.01, abs=1e-12)
    assert 0.0 < pass_at_k(1000, 1, 10) < 1.0


@pytest.mark.parametrize(
    "n, c, k",
    [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (5.0, 2, 2), (5, 2, 2.0), (True, 1, 1), (5, 2, -1)],
)
def test_bad_input_raises(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_batch_averages_over_problems():
    correct = [
        [True, False, False, True, False],  # n=5, c=2 → pass@2 = 0.7
        [False, False, False, False],  # n=4, c=0 → 0
        [True, True, True],  # n=3, c=3 → 1
    ]
    assert pass_at_k_batch(correct, 2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    assert pass_at_k_batch(correct, 1) == pytest.approx((0.4 + 0.0 + 1.0) / 3)
    assert pass_at_k_batch(correct, 1) == pytest.approx(mean_at_k(correct))  # pass@1 is mean@k
    for k in (1, 2, 3):  # each problem's value is its brute-force count
        assert pass_at_k_batch(correct, k) == pytest.approx(sum(brute_force(r, k) for r in correct) / 3)


def test_mean_at_k_is_the_mean_fraction_correct():
    assert mean_at_k([[True, False, False, True], [True], [False, False]]) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert mean_at_k([(1, 0, 1)]) == pytest.approx(2 / 3)  # any truthy values, any sequences


def test_batch_bad_input_raises():
    with pytest.raises(ValueError, match="no problems"):
        pass_at_k_batch([], 1)
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        pass_at_k_batch([[True], []], 1)
    with pytest.raises(ValueError, match="k must be <= n"):
        pass_at_k_batch([[True, False], [True]], 2)
    with pytest.raises(ValueError, match="no problems"):
        mean_at_k([])
