"""The pieces of the one RL iteration (lit_rlhf/modules/rl.py) that are plain functions."""

import torch
from torch import nn

from lit_rlhf.modules.rl import has_dropout, mean_over_minibatches, minibatch_indices


def test_minibatches_cover_every_index_once_per_pass():
    g = torch.Generator().manual_seed(0)
    mbs = list(minibatch_indices(10, 4, 2, g))
    assert [len(m) for m in mbs] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(mbs[:3]).tolist()) == list(range(10)) == sorted(torch.cat(mbs[3:]).tolist())


def test_minibatch_statistics_are_means_but_the_ratio_maximum():
    stats = {
        "policy/loss": [torch.tensor(1.0), torch.tensor(3.0)],
        "policy/ratio_max": [torch.tensor(1.5), torch.tensor(1.2)],
    }
    out = mean_over_minibatches(stats)
    assert out["policy/loss"].item() == 2.0 and out["policy/ratio_max"].item() == 1.5


def test_has_dropout_sees_modules_and_transformers_configs():
    assert not has_dropout(None) and not has_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
    assert has_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))

    class WithConfig(nn.Module):
        config = type("C", (), {"attention_dropout": 0.1})()

    assert has_dropout(WithConfig())
