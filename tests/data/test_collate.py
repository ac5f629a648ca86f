import torch

from lit_rlhf.data.chat import get_template
from lit_rlhf.data.collate import collate_sft, encode_pair, pad
from lit_rlhf.data.templates import ChatTemplate

PLAIN = get_template("plain")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_encode_pair_appends_eos_and_keeps_bos(tokenizer):
    e = encode_pair(tokenizer, "the dog", "sees a cat", PLAIN, max_length=64)
    assert e.prompt_ids == [tokenizer.bos_token_id] + ids(tokenizer, "the dog")
    assert e.response_ids == ids(tokenizer, "sees a cat") + [tokenizer.eos_token_id]
    assert (e.prompt_cut, e.response_cut) == (0, 0)


def test_overlong_pair_cuts_prompt_from_left_keeping_bos(tokenizer):
    # prompt = <bos> + 4 words (5 tokens), response = 3 words + eos (4 tokens), budget 7
    e = encode_pair(tokenizer, "the happy old dog", "sees a cat", PLAIN, max_length=7)
    assert e.prompt_ids == [tokenizer.bos_token_id] + ids(tokenizer, "old dog")
    assert len(e.prompt_ids) + len(e.response_ids) == 7
    assert e.prompt_cut == 2 and e.response_cut == 0


def test_response_alone_too_long_is_cut_from_the_right(tokenizer):
    e = encode_pair(tokenizer, "the", "dog sees a cat", PLAIN, max_length=3)
    assert e.response_cut == 3  # 5 response tokens (4 words + eos) into a budget of 2
    assert e.response_ids == ids(tokenizer, "dog sees")
    assert len(e.prompt_ids) == 1  # min_prompt_tokens kept (the last prompt token)
    assert e.prompt_ids == ids(tokenizer, "the")


def test_template_is_applied(tokenizer):
    t = ChatTemplate("{prompt} dog", "")
    e = encode_pair(tokenizer, "the", "sees", t, max_length=16)
    assert e.prompt_ids == [tokenizer.bos_token_id] + ids(tokenizer, "the dog")


def test_pad_left_and_right_round_trip():
    seqs = [[5, 6, 7], [8]]
    right, rmask = pad(seqs, 0, "right")
    left, lmask = pad(seqs, 0, "left")
    assert right.tolist() == [[5, 6, 7], [8, 0, 0]] and rmask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert left.tolist() == [[5, 6, 7], [0, 0, 8]] and lmask.tolist() == [[1, 1, 1], [0, 0, 1]]
    for ids_, mask in ((right, rmask), (left, lmask)):  # the mask recovers each sequence exactly
        assert [row[m.bool()].tolist() for row, m in zip(ids_, mask)] == seqs


def test_pad_id_equal_to_eos_does_not_hide_eos(tokenizer):
    """Masks come from lengths: an EOS inside a sequence stays a real token even if pad == eos."""
    eos = tokenizer.eos_token_id
    ids_, mask = pad([[4, eos], [4]], pad_id=eos, side="right")
    assert mask.tolist() == [[1, 1], [1, 0]]


def test_collate_sft_response_mask(tokenizer):
    a = encode_pair(tokenizer, "the dog", "sees a cat", PLAIN, 64)
    b = encode_pair(tokenizer, "a", "cat", PLAIN, 64)
    batch = collate_sft([a, b], pad_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, 3 + 4)
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    resp = batch["input_ids"][batch["response_mask"].bool()].tolist()
    assert resp == a.response_ids + b.response_ids
    assert batch["input_ids"].dtype == torch.long


def test_encode_pairs_gives_encode_pairs_ids_row_by_row(tokenizer, tmp_path):
    """The batched encoding (one tokenizer call per side, used by the SFT and preference data) equals
    encode_pair on each row: real HH-RLHF dialogues with a byte-level BPE learned from them (the
    dialogue and human_assistant templates; max_length cuts prompts and responses), and the embedded
    task's tokenizer with texts that already end in EOS, empty responses and cuts."""
    import gzip
    import json

    import pytest

    from lit_rlhf.data.bpe import BPETokenizerConfig, train_bpe
    from lit_rlhf.data.collate import encode_pairs
    from lit_rlhf.data.tokenizers import prepare_tokenizer
    from tests.conftest import HH_FILE as hh

    if not hh.exists():
        pytest.skip(f"no local copy of the HH-RLHF file at {hh}")
    with gzip.open(hh, "rt") as fh:
        rows = [json.loads(line) for _, line in zip(range(300), fh)]
    cut = [r["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:") for r in rows]
    prompts = [r["chosen"][:k] for r, k in zip(rows, cut)]
    responses = [r["chosen"][k:].strip() for r, k in zip(rows, cut)] + [
        r["rejected"][k:].strip() for r, k in zip(rows, cut)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"t": r["chosen"]}) + "\n" for r in rows))
    bpe = prepare_tokenizer(train_bpe(BPETokenizerConfig(source=str(tmp_path / "c.jsonl"), vocab_size=400)))
    cases = [(bpe, prompts * 2, responses, name, n) for name in ("dialogue", "human_assistant") for n in (64, 1024)]
    eos = tokenizer.eos_token
    cases.append(
        (
            tokenizer,
            ["the dog", "a", "the happy old dog", "every"],
            ["sees a cat", "", f"runs {eos}", "the"],
            "plain",
            4,
        )
    )
    for tok, ps, rs, name, max_length in cases:
        template = get_template(name)
        batched = encode_pairs(tok, ps, rs, template, max_length)
        assert batched == [encode_pair(tok, p, r, template, max_length) for p, r in zip(ps, rs)], (name, max_length)
        if max_length < 100:  # both cuts exercised
            assert any(e.prompt_cut for e in batched) and any(e.response_cut for e in batched), (name, max_length)
