import statistics

import pytest
import torch

from lit_rlhf.core.running_stats import RunningMoments


def test_matches_statistics_over_the_whole_stream():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 4 + 10 for n in (1, 7, 30, 2)]
    m = RunningMoments()
    for b in batches:
        m.update(b)
    everything = torch.cat(batches).tolist()
    assert m.count == len(everything)
    assert m.mean == pytest.approx(statistics.mean(everything))
    assert m.std == pytest.approx(statistics.stdev(everything))  # Bessel-corrected


def test_all_reduce_merges_ranks():
    """Rank a's batch + rank b's batch through an all_reduce == both batches on one rank."""
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    single = RunningMoments()
    single.update(torch.cat([a, b]))
    calls = []

    def fake_all_reduce(t):
        if not calls:
            t += torch.tensor([2.0, 30.0])  # rank b's (count, sum)
        else:
            mean = 36.0 / 5
            t += ((b - mean) ** 2).sum()
        calls.append(1)
        return t

    multi = RunningMoments()
    mean_b, std_b = multi.update(a, fake_all_reduce)
    assert (multi.count, multi.mean) == (5.0, pytest.approx(single.mean)) and multi.std == pytest.approx(single.std)
    assert mean_b == pytest.approx(7.2) and std_b == pytest.approx(statistics.stdev([1, 2, 3, 10, 20]))


def test_state_round_trip_and_defaults():
    m = RunningMoments()
    assert m.std == 1.0  # no data yet: scaling is the identity
    m.update(torch.tensor([1.0, 3.0]))
    n = RunningMoments()
    n.load_state_dict(m.state_dict())
    assert (n.count, n.mean, n.m2) == (2.0, 2.0, 2.0)
