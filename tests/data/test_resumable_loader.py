"""Exact resume of the data order (lit_rlhf/data/sampler.py, lit_rlhf/data/loader.py): a loader
restored from a mid-epoch state yields exactly the batches the uninterrupted loader yields next."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lit_rlhf.data.loader import ResumableDataLoader
from lit_rlhf.data.sampler import EpochSampler, LengthGroupedSampler, epoch_generator


def _loader(n: int = 23, batch_size: int = 4, seed: int = 7, **kw) -> ResumableDataLoader:
    return ResumableDataLoader(list(range(n)), batch_size=batch_size, sampler=EpochSampler(n, seed=seed, **kw))


def _epoch(loader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [b.tolist() for b in loader]


def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    s = EpochSampler(50, seed=3)
    s.set_epoch(2)
    first = list(s)
    assert sorted(first) == list(range(50))  # a permutation
    s.set_epoch(0)
    assert list(s) != first
    s.set_epoch(2)
    assert list(s) == first  # the same epoch again: the same order (a RandomSampler moves on)
    other = EpochSampler(50, seed=3)
    other.set_epoch(2)
    assert list(other) == first  # a fresh sampler (a resumed process): the same order
    # neighbouring (seed, epoch) pairs are independent streams, unlike manual_seed(seed + epoch)
    assert torch.equal(
        torch.randperm(50, generator=epoch_generator(1, 0)), torch.randperm(50, generator=epoch_generator(1, 0))
    )
    assert not torch.equal(
        torch.randperm(50, generator=epoch_generator(1, 0)), torch.randperm(50, generator=epoch_generator(0, 1))
    )


def test_epoch_sampler_with_replacement_draws_num_samples():
    s = EpochSampler(5, seed=0, replacement=True, num_samples=40)
    draws = list(s)
    assert len(s) == len(draws) == 40
    assert set(draws) <= set(range(5)) and len(set(draws)) > 1
    assert len(draws) != len(set(draws))  # 40 draws from 5: repeats


def test_epoch_sampler_shards_split_the_epoch_disjointly():
    """Each rank's share is every world_size-th index of the unsharded order: together the
    first 3 x 7 of it, disjoint, the same length on every rank (the tail of 2 is dropped)."""
    whole = EpochSampler(23, seed=5)
    whole.set_epoch(4)
    order = list(whole)
    shards = []
    for rank in range(3):
        s = EpochSampler(23, seed=5, shard=(rank, 3))
        s.set_epoch(4)
        shards.append(list(s))
        assert len(s) == 7 and shards[-1] == [order[i] for i in range(rank, 21, 3)]
    assert sorted(sum(shards, [])) == sorted(order[:21])
    import pytest

    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        EpochSampler(10, shard=(2, 2))


def test_extra_prompts_differ_across_ranks():
    """DAPO's extra prompt loader is not wrapped by Lightning: each rank must draw its own share."""
    from types import SimpleNamespace

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(tokenizer="synthetic"))
    batches = []
    for rank in range(2):
        dm = PromptDataModule(n_train=40, n_val=0, batch_size=4).connect(tok)
        dm.setup("fit")
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        loader = dm.extra_dataloader()
        assert loader.sampler.shard == (rank, 2)  # disjoint shares of one order (the sampler test above)
        batches.append([p for b in loader for p in b["prompts"]])
    assert len(batches[0]) == len(batches[1]) == 20 and batches[0] != batches[1]


def test_length_grouped_sampler_same_order_in_a_fresh_process():
    lengths = [(i * 37) % 19 for i in range(64)]
    a, b = LengthGroupedSampler(lengths, 8, seed=2), LengthGroupedSampler(lengths, 8, seed=2)
    a.set_epoch(3), b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)


def test_resume_mid_epoch_yields_the_remaining_batches():
    full = _loader()
    reference = _epoch(full, 1)  # 6 batches: 5 of 4, one of 3
    for consumed in range(1, len(reference)):
        first = _loader()
        first.sampler.set_epoch(1)
        it = iter(first)
        for _ in range(consumed):
            next(it)
        state = first.state_dict()
        assert state == {"epoch": 1, "batches": consumed, "length": 6}
        resumed = _loader()
        resumed.load_state_dict(state)
        assert _epoch(resumed, 1) == reference[consumed:]
        assert _epoch(resumed, 2) == _epoch(_loader(), 2)  # the next epoch is whole again


def test_resume_after_a_finished_or_cut_epoch_starts_the_next_one():
    done = _loader()
    _epoch(done, 1)
    resumed = _loader()
    resumed.load_state_dict(done.state_dict())  # saved at the epoch's last batch
    assert _epoch(resumed, 2) == _epoch(_loader(), 2)
    cut = _loader()
    cut.sampler.set_epoch(1)
    it = iter(cut)
    next(it), next(it)  # limit_train_batches=2: Lightning moves on to epoch 2
    resumed = _loader()
    resumed.load_state_dict(cut.state_dict())
    assert _epoch(resumed, 2) == _epoch(_loader(), 2)


def test_changed_dataset_size_is_reported(caplog):
    first = _loader(n=23)
    first.sampler.set_epoch(0)
    it = iter(first)
    next(it)
    resumed = _loader(n=31)
    resumed.load_state_dict(first.state_dict())
    with caplog.at_level("WARNING"):
        batches = _epoch(resumed, 0)
    assert len(batches) == 8 - 1  # 31 rows / 4 = 8 batches, the first skipped
    assert "training data changed since the checkpoint" in caplog.text


def test_iterating_does_not_touch_the_global_rng():
    before = torch.get_rng_state()
    _epoch(_loader(), 0)
    assert torch.equal(torch.get_rng_state(), before)
    # the check can fail: a plain DataLoader draws its worker base seed from the global generator
    list(DataLoader(list(range(8)), batch_size=4))
    assert not torch.equal(torch.get_rng_state(), before)


def test_grpo_extra_prompt_cycle_resumes_across_passes():
    from lit_rlhf.modules.critic_free import _cycle

    def take(skip: int, k: int) -> list[list[int]]:
        gen = _cycle(_loader(n=12, batch_size=4), skip=skip)
        return [next(gen).tolist() for _ in range(k)]

    stream = take(0, 10)  # 3 batches per pass: passes 0, 1, 2 and one of pass 3
    assert stream[0:3] != stream[3:6]  # a new order every pass
    for skip in (1, 3, 4, 8):
        assert take(skip, 10 - skip) == stream[skip:]
