import gzip
import json
import logging

import pytest

from lit_rlhf.data.io import DataError
from lit_rlhf.data.sft import SFTDataModule
from lit_rlhf.utils.config import ConfigError


def write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


ROWS = [{"prompt": f"the dog {i % 3}", "response": "sees a cat"} for i in range(40)]


def make(tokenizer, **kw):
    dm = SFTDataModule(**kw).connect(tokenizer)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "json", "parquet"])
def test_reads_every_file_format(tmp_path, tokenizer, fmt):
    path = tmp_path / f"train.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    else:
        write_jsonl(path, ROWS, gz=fmt.endswith("gz"))
    dm = make(tokenizer, source=str(path), val_fraction=0.25, batch_size=8)
    assert dm.stats["train_pairs"] == 30 and dm.stats["val_pairs"] == 10
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "response_mask"}
    assert batch["input_ids"].shape[0] == 8


def test_field_names_are_configurable(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "the dog", "answer": "sees"}] * 4)
    dm = make(tokenizer, source=path, prompt_field="question", response_field="answer", val_fraction=0.0)
    assert dm.stats["train_pairs"] == 4 and dm.val_dataloader() == []


def test_malformed_json_names_file_and_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], '{"prompt": "x", "response": ', ROWS[2]])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        make(tokenizer, source=path)


def test_missing_field_names_row_and_available_keys(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "f.jsonl.gz", [ROWS[0], {"prompt": "x", "answer": "y"}], gz=True)
    with pytest.raises(DataError, match=r"f\.jsonl\.gz:2: missing field 'response'; the row has: answer, prompt"):
        make(tokenizer, source=path)


def test_non_string_field_is_rejected(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x", "response": 3}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: field 'response' must be a string, got int"):
        make(tokenizer, source=path)


def test_non_object_line_is_rejected(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "l.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"l\.jsonl:1: expected a JSON object, got list"):
        make(tokenizer, source=path)


def test_empty_dataset_fails_clearly(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable SFT rows \(0 read"):
        make(tokenizer, source=str(path))


def test_empty_responses_are_skipped_and_counted_or_rejected(tmp_path, tokenizer, caplog):
    rows = ROWS[:10] + [{"prompt": "a", "response": "  "}] * 3
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lit_rlhf.data.sft"):
        dm = make(tokenizer, source=path, val_fraction=0.0)
    assert dm.stats["train_skipped_empty"] == 3 and dm.stats["train_pairs"] == 10
    assert "3 skipped for an empty response" in caplog.text
    with pytest.raises(DataError, match=r"e\.jsonl:11: empty response"):
        make(tokenizer, source=path, on_empty="error")


def test_truncations_are_counted_and_logged(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "the happy old dog", "response": "sees a cat"}] * 4
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lit_rlhf.data.sft"):
        dm = make(tokenizer, source=path, val_fraction=0.0, max_length=6)
    assert dm.stats["train_prompts_cut"] == 4
    assert "4 prompts cut from the left" in caplog.text


def test_missing_file_and_bad_config(tmp_path, tokenizer):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        make(tokenizer, source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match=r"data\.val_fraction: must be >= 0.0 and < 1.0, got 1.5"):
        SFTDataModule(val_fraction=1.5)
    with pytest.raises(ConfigError, match=r"data\.template: must be one of"):
        SFTDataModule(template="chatml")


def test_synthetic_source_and_reference_perplexity(tokenizer):
    dm = make(tokenizer, n_train=100, n_val=50)
    assert dm.stats["train_pairs"] == 100 and dm.stats["val_pairs"] == 50
    lang = dm._task.language
    # reference = exp(mean NLL) of exactly the validation response tokens (words + EOS)
    assert 0.5 * lang.perplexity_floor() < dm.reference_perplexity < 2.0 * lang.perplexity_floor()
    n_tokens = sum(len(p.response_ids) for p in dm.val_set)
    words = sum(len(r["response"].split()) + 1 for r in dm._task.sft_records(50, "val"))
    assert n_tokens == words


def test_connect_is_required(tokenizer):
    with pytest.raises(RuntimeError, match="connect"):
        SFTDataModule(n_train=10).setup("fit")


def test_reads_a_datasets_folder_with_splits(tmp_path, tokenizer):
    import datasets

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:30]), "test": datasets.Dataset.from_list(ROWS[30:])}
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    dm = make(tokenizer, source=str(tmp_path / "ds"), val_split="test")
    assert dm.stats["train_pairs"] == 30 and dm.stats["val_pairs"] == 10


def test_unreachable_hub_dataset_says_what_to_do(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"could not load dataset 'nobody/none'.*local \.jsonl"):
        make(tokenizer, source="nobody/none")
