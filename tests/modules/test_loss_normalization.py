"""The RL loss does not depend on how a minibatch is sharded (``algo.loss_normalization=global``,
docs/algorithms.md §6): a 2-process DDP step over shards of very different sizes and response lengths
gives the gradient of one process on the whole minibatch, for every aggregation, and so does each
shard accumulated over micro-batches of one row; per-rank counts (``local``) do not."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from lit_rlhf.core.losses import aggregate
from lit_rlhf.core.objectives import AGGREGATIONS, POLICY_LOSSES
from lit_rlhf.modules.rl import RLModule

# one worker builds the 2-process gradients for every test of this file (pytest-xdist would spread them)
pytestmark = pytest.mark.xdist_group("loss_normalization")

VOCAB, T = 11, 7
LENGTHS = [7, 1, 4, 2, 6]  # rows 0-2 on rank 0, rows 3-4 on rank 1: unequal rows and tokens
SHARDS = {0: [0, 1, 2], 1: [3, 4]}


def _batch():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(len(LENGTHS), T, 5, generator=g)
    labels = torch.randint(0, VOCAB, (len(LENGTHS), T), generator=g)
    mask = torch.zeros(len(LENGTHS), T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    old = -torch.rand(len(LENGTHS), T, generator=g) * 2
    adv = torch.randn(len(LENGTHS), 1, generator=g).expand(-1, T).clone()
    return feats, labels, mask, old, adv


def _model():
    torch.manual_seed(1)
    return torch.nn.Linear(5, VOCAB)


def _loss(model, rows, aggregation, normalizer, objective="clip"):
    feats, labels, mask, old, adv = (x[rows] for x in _batch())
    logprobs = torch.log_softmax(model(feats), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    loss, _ = POLICY_LOSSES[objective].fn(
        logprobs, old, adv, mask, 0.2, 0.2, None, aggregation, float(T), None, normalizer
    )
    return loss


def _normalizer(mask, aggregation, mode, world):
    """The module's own ``loss_counts`` (its all-reduce), on a stand-in for the module: the count
    ``aggregation`` divides by."""
    fake = SimpleNamespace(
        _trainer=SimpleNamespace(world_size=world),
        config=SimpleNamespace(loss_normalization=mode, loss_aggregation=aggregation),
        device=torch.device("cpu"),
    )
    fake.count_over_ranks = lambda local: RLModule.count_over_ranks(fake, local)
    return RLModule.loss_counts(fake, mask).for_aggregation(aggregation)


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        grads = {}
        for aggregation in AGGREGATIONS:
            for mode in ("global", "local"):
                for objective in ("clip", "gspo", "cispo"):
                    model = DistributedDataParallel(_model())
                    rows = SHARDS[rank]
                    normalizer = _normalizer(_batch()[2][rows], aggregation, mode, 2)
                    _loss(model, rows, aggregation, normalizer, objective).backward()  # DDP averages
                    grads[(aggregation, mode, objective)] = [p.grad.clone() for p in model.parameters()]
                    # and each shard accumulated over two micro-batches ([0, 1] + [2], [3] + [4]), each
                    # dividing by the same counts (every rank runs as many backward passes: DDP's all-reduces pair up)
                    model.zero_grad()
                    for part in (rows[:-1], rows[-1:]):
                        _loss(model, part, aggregation, normalizer, objective).backward()
                    grads[(aggregation, mode, objective, "micro")] = [p.grad.clone() for p in model.parameters()]
        torch.save(grads, f"{out}/rank{rank}.pt")
        del model  # the last DDP reducer, before its process group goes
    finally:
        dist.destroy_process_group()
    # no interpreter shutdown: there a DDP reducer's gloo group can deadlock in its destructor (a gloo
    # thread waiting for the GIL the dealloc holds), which hung this fixture until pytest's timeout
    os._exit(0)


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ddp_loss")
    mp.start_processes(_rank, args=(str(tmp / "store"), str(tmp)), nprocs=2, start_method="spawn")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("objective", ["clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_a_sharded_step_has_the_whole_minibatchs_gradient(two_rank_grads, aggregation, objective):
    model = _model()
    _loss(model, list(range(len(LENGTHS))), aggregation, None, objective).backward()  # one process, all rows
    whole = [p.grad for p in model.parameters()]
    for grads in two_rank_grads:  # DDP leaves every rank the same averaged gradient
        for got, want in zip(grads[(aggregation, "global", objective)], whole):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        for got, want in zip(grads[(aggregation, "global", objective, "micro")], whole):  # sharded and accumulated
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        # the per-rank counts weigh the small shard's rows and tokens up: another gradient
        assert not all(
            torch.allclose(g, w, rtol=1e-3, atol=1e-6) for g, w in zip(grads[(aggregation, "local", objective)], whole)
        )


def test_alone_or_local_the_counts_are_the_ranks_own_and_aggregate_divides_by_the_one_given():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for mode, world in (("global", 1), ("local", 2)):  # no collective: this rank's tokens and rows
        assert float(_normalizer(mask, "token_mean", mode, world)) == 3.0
        assert float(_normalizer(mask, "seq_mean_token_mean", mode, world)) == 2.0
    assert float(_normalizer(torch.zeros(2, 3), "token_mean", "global", 1)) == 1.0  # never 0: no NaN
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    assert float(aggregate(x, mask, "token_mean", normalizer=2.0)) == 3.5  # (1 + 2 + 4) / 2
    assert float(aggregate(x, mask, "seq_mean_token_mean", normalizer=4.0)) == 1.375  # (1.5 + 4) / 4
    assert float(aggregate(x, mask, "seq_sum_constant", 3.0, normalizer=1.0)) == pytest.approx(7 / 3)
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(7 / 3)  # its own count, as before
