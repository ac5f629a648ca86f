"""KTO's data (docs/algorithms.md §5.3): unpaired prompt/completion/label rows, pairs split into a desirable
and an undesirable example, each example's KL row (its prompt with another prompt's completion), bad rows."""

import json
import logging

import pytest

from lit_rlhf.data.io import DataError, Row
from lit_rlhf.data.preference import PreferenceDataModule, detect_format, kl_partners, parse_example


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def make(tokenizer, **kw):
    dm = PreferenceDataModule(unpaired=True, val_fraction=0.0, group_by_length=False, **kw).connect(tokenizer)
    dm.setup("fit")
    return dm


def text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_pairs_split_into_desirable_and_undesirable_examples_with_mismatched_kl_rows(tmp_path, tokenizer):
    """Pairs (p0: w0 > l0), (p1: w1 > l1), (p2: w2 > l2) → examples w0 w1 w2 (desirable) then l0 l1 l2;
    the KL row of example i is its prompt with example i − 1's completion (cyclically): by hand,
    (p0, l2), (p1, w0), (p2, w1), (p0, w2), (p1, l0), (p2, l1)."""
    rows = [
        {"prompt": "the dog", "chosen": "sees a cat", "rejected": "cat"},
        {"prompt": "a bird", "chosen": "helps", "rejected": "sad bird"},
        {"prompt": "my house", "chosen": "warm house", "rejected": "house house"},
    ]
    dm = make(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", rows))
    ex = dm.splits["train"]
    got = [(e.prompt, text(tokenizer, e.completion.response_ids), e.desirable) for e in ex]
    assert got == [
        ("the dog", "sees a cat", True),
        ("a bird", "helps", True),
        ("my house", "warm house", True),
        ("the dog", "cat", False),
        ("a bird", "sad bird", False),
        ("my house", "house house", False),
    ]
    kl = [(text(tokenizer, e.kl.prompt_ids), text(tokenizer, e.kl.response_ids)) for e in ex]
    assert kl == [
        ("the dog", "house house"),
        ("a bird", "sees a cat"),
        ("my house", "helps"),
        ("the dog", "warm house"),
        ("a bird", "cat"),
        ("my house", "sad bird"),
    ]
    assert [e.index for e in ex] == list(range(6))
    assert (dm.stats["train_examples"], dm.stats["train_desirable"]) == (6, 3)
    # one batch: completion rows, then their KL rows; labels and positions ride along
    batch = next(iter(dm._loader("train", train=False, batch_size=4)))
    assert batch["input_ids"].shape[0] == 8 and batch["desirable"].tolist() == [True, True, True, False]
    resp = [text(tokenizer, row[m.bool()].tolist()) for row, m in zip(batch["input_ids"], batch["response_mask"])]
    assert resp == ["sees a cat", "helps", "warm house", "cat", "house house", "sees a cat", "helps", "warm house"]
    assert batch["pair_index"].tolist() == [0, 1, 2, 3] and batch["prompts"] == [
        "the dog",
        "a bird",
        "my house",
        "the dog",
    ]


def test_unpaired_rows_are_detected_parsed_and_their_kl_rows_skip_the_same_prompt(tmp_path, tokenizer):
    rows = [
        {"prompt": "the dog", "completion": "sees a cat", "label": True},
        {"prompt": "the dog", "completion": "cat cat", "label": False},
        {"prompt": "a bird", "completion": "helps", "label": True},
        {"prompt": "a bird", "completion": "sad", "label": False},
    ]
    path = write_jsonl(tmp_path / "u.jsonl", rows)
    assert detect_format(Row(rows[0], "u.jsonl:1", 1)) == "unpaired"
    dm = make(tokenizer, source=path)
    assert [(e.prompt, e.completion, e.desirable) for e in dm.examples["train"]] == [tuple(r.values()) for r in rows]
    # example 1 (the dog) skips example 0 (the dog too) for example 3's completion (a bird); 2 takes 1's
    assert kl_partners([e.prompt for e in dm.examples["train"]], "x") == [3, 3, 1, 1]
    kl = [text(tokenizer, e.kl.response_ids) for e in dm.splits["train"]]
    assert kl == ["sad", "sad", "cat cat", "cat cat"]
    with pytest.raises(DataError, match=r"x: KTO's reference point pairs each prompt with another prompt's completion"):
        kl_partners(["same", "same"], "x")


def test_bad_unpaired_rows_are_named_or_counted(tmp_path, tokenizer, caplog):
    good = {"prompt": "the dog", "completion": "sees a cat", "label": True}
    missing = write_jsonl(tmp_path / "m.jsonl", [good, {"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: missing field 'label' \(true = desirable, false = undesirable\)"):
        make(tokenizer, source=missing, format="unpaired")
    for label in (1, "true", None):
        bad = write_jsonl(tmp_path / "b.jsonl", [good, dict(good, label=label)])
        with pytest.raises(DataError, match=rf"b\.jsonl:2: field 'label' must be true or false .*got {label!r}"):
            make(tokenizer, source=bad)
    no_prompt = write_jsonl(tmp_path / "p.jsonl", [good, {"completion": "b", "label": True}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: missing field 'prompt'"):
        make(tokenizer, source=no_prompt, format="unpaired")
    rows = [
        good,
        {"prompt": "a bird", "completion": "  ", "label": False},
        {"prompt": "a bird", "completion": "helps", "label": False},
    ]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lit_rlhf.data.preference"):
        dm = make(tokenizer, source=path)
    assert dm.stats["train_skipped_empty"] == 1 and dm.stats["train_examples"] == 2 and "skipped 1 empty" in caplog.text
    with pytest.raises(DataError, match=r"e\.jsonl:2: empty completion"):
        make(tokenizer, source=path, on_empty="error")
    # unpaired rows cannot train a pairwise loss (the reward model, DPO …)
    with pytest.raises(DataError, match=r"u\.jsonl:1: unpaired rows \(prompt, completion, label\) have no pairs"):
        PreferenceDataModule(source=write_jsonl(tmp_path / "u.jsonl", [good] * 2)).connect(tokenizer).setup("fit")


def test_embedded_pairs_split_and_count(tokenizer):
    dm = make(tokenizer, n_train=40, n_val=8, n_test=4, batch_size=8)
    assert {s: len(v) for s, v in dm.splits.items()} == {"train": 80, "val": 16, "test": 8}
    pairs, ex = dm.pairs["train"], dm.examples["train"]
    assert [(e.prompt, e.completion) for e in ex] == [(p.prompt, p.chosen) for p in pairs] + [
        (p.prompt, p.rejected) for p in pairs
    ]
    assert all(
        e.kl.prompt_ids == e.completion.prompt_ids for e in dm.splits["train"]
    )  # same prompt, another completion
    assert parse_example(Row({"prompt": "a", "completion": "b", "label": False}, "w")).desirable is False
