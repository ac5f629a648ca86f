"""Conversations and the tokenizer's chat template (lit_rlhf/data/chat.py), with the ChatML- and
Llama-3-style Jinja templates (data/chat.py CHAT_TEMPLATES, no download) on a byte-level BPE learned
from a few lines; every rendering is checked against one written out here."""

from __future__ import annotations

import json

import pytest

from lit_rlhf.data.chat import (
    check_messages,
    end_of_turn_ids,
    hh_to_messages,
    render_prompt,
    render_with_assistant_mask,
)
from lit_rlhf.data.io import DataError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Say yes"},
    {"role": "assistant", "content": "yes"},
]


def make_chat_tokenizer(kind, folder):
    """A byte-level BPE learned from a few lines, with the ChatML or the Llama-3-style template
    (model.train_tokenizer.chat_template; the renderings below are written out by hand)."""
    from lit_rlhf.data.bpe import BPETokenizerConfig, train_bpe

    path = folder / "c.jsonl"
    lines = ["Hi there, how can I help? Say yes. Be brief.", "Hello there, yes, no, help me say it."] * 20
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return train_bpe(BPETokenizerConfig(source=str(path), vocab_size=300, chat_template=kind))


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def chat_tokenizer(request, tmp_path_factory):
    return request.param, make_chat_tokenizer(request.param, tmp_path_factory.mktemp("corpus"))


def test_assistant_mask_covers_exactly_the_assistant_turns(chat_tokenizer):
    kind, tok = chat_tokenizer
    ids, mask = render_with_assistant_mask(tok, CONVERSATION)
    assert len(ids) == len(mask)
    full = tok.decode(ids)
    masked = [tok.decode([i for i, m in zip(ids, mask) if m][a:b]) for a, b in _runs(mask)]
    if kind == "chatml":
        assert full == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello, how can I help?<|im_end|>\n<|im_start|>user\nSay yes<|im_end|>\n"
            "<|im_start|>assistant\nyes<|im_end|>\n"
        )
        assert masked == ["Hello, how can I help?<|im_end|>\n", "yes<|im_end|>\n"]
    else:
        assert full.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
        assert masked == ["Hello, how can I help?<|eot_id|>", "yes<|eot_id|>"]
    # the prompt before each assistant turn is the template's own generation prompt
    prompt = render_prompt(tok, CONVERSATION[:2])
    assert prompt.endswith(
        "<|im_start|>assistant\n" if kind == "chatml" else "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def _runs(mask):
    """(start, end) of each run of 1s, counted in masked tokens."""
    out, n, start = [], 0, None
    for m in mask + [0]:
        if m and start is None:
            start = n
        if not m and start is not None:
            out.append((start, n))
            start = None
        n += m
    return out


def test_end_of_turn_is_the_templates_closing_token(chat_tokenizer):
    kind, tok = chat_tokenizer
    expected = "<|im_end|>" if kind == "chatml" else "<|eot_id|>"
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids(expected)]


def test_hh_dialogue_to_messages():
    text = "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:"
    assert hh_to_messages(text, "f.jsonl:3") == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    # two turns in a row by one side (9 harmless-base rows): one turn, joined by a blank line
    assert hh_to_messages(
        "\n\nHuman: Hi\n\nAssistant: Hello.\n\nAssistant: Anyone?\n\nHuman: yes\n\nAssistant:", "r"
    ) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.\n\nAnyone?"},
        {"role": "user", "content": "yes"},
    ]
    with pytest.raises(DataError, match="f.jsonl:4: not an HH-RLHF dialogue"):
        hh_to_messages("Hello\n\nAssistant: hi", "f.jsonl:4")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user"}], "message 0 needs a role and a content"),
        ([{"role": "bot", "content": "x"}], "message 0 has role 'bot'"),
        ([{"role": "user", "content": 3}], "message 0 \\(user\\) content must be a string"),
        ([{"role": "assistant", "content": "x"}], "message 0 is assistant, expected user"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 is user, expected assistant"),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            "message 1 is system, expected assistant \\(a system message is allowed only first",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}],
            "message 1 is an empty assistant turn",
        ),
        ([{"role": "system", "content": "s"}], "a system message alone"),
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
    ],
)
def test_bad_conversations_name_the_row_and_message(messages, message):
    with pytest.raises(DataError, match=f"data.jsonl:7: {message}"):
        check_messages(messages, "data.jsonl:7")


def test_last_turn_rule():
    ok = [{"role": "user", "content": "a"}]
    assert check_messages(ok, "r", ends_with="user") == ok
    with pytest.raises(DataError, match="r: the last message is user, expected assistant"):
        check_messages(ok, "r", ends_with="assistant")


def test_conversation_as_an_sft_pair_masks_every_assistant_turn(chat_tokenizer):
    from lit_rlhf.data.chat import encode_conversation
    from lit_rlhf.data.collate import collate_sft

    kind, tok = chat_tokenizer
    ids, mask = render_with_assistant_mask(tok, CONVERSATION)
    pair = encode_conversation(tok, CONVERSATION, max_length=512)
    assert pair.prompt_ids + pair.response_ids == ids[: len(pair.prompt_ids) + len(pair.response_ids)]
    end = "<|im_end|>\n" if kind == "chatml" else "<|eot_id|>"
    assert tok.decode(pair.response_ids) == "yes" + end  # the last assistant turn is the response
    batch = collate_sft([pair], pad_id=tok.pad_token_id)
    assert batch["response_mask"][0].tolist() == mask[: len(batch["response_mask"][0])]
    scored = [i for i, m in zip(batch["input_ids"][0].tolist(), batch["response_mask"][0].tolist()) if m]
    assert tok.decode(scored) == "Hello, how can I help?" + end + "yes" + end
    # too long: the prompt loses tokens from the left (its first token kept), the mask with it
    short = encode_conversation(tok, CONVERSATION, max_length=len(ids) - 3)
    assert short.prompt_cut == 3 and short.prompt_ids == ids[:1] + ids[4 : len(pair.prompt_ids)]
    assert list(short.prompt_loss_mask) == mask[:1] + mask[4 : len(pair.prompt_ids)]


@pytest.mark.integration
def test_sft_on_a_messages_file_through_train_py(tmp_path):
    """data.sft.format=messages with template=auto: a tiny Llama with the ChatML tokenizer trains on
    a conversations file; a row with its roles out of order is named by file and line."""
    from transformers import AutoTokenizer

    from lit_rlhf.launch.runner import run
    from tests.conftest import compose

    tok = make_chat_tokenizer("chatml", tmp_path)
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    rows = [CONVERSATION, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]] * 8
    good = tmp_path / "chat.jsonl"
    good.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    args = [
        "algo=sft",
        "model=tiny_llama",
        f"model.tokenizer={tok_dir}",
        "data=sft_file",
        "data.sft.format=messages",
        "data.sft.template=auto",
        "data.sft.max_length=64",
        "data.batch_size=4",
        "trainer.max_steps=3",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "logger=none",
        "model.tiny.hidden_size=32",
        "model.tiny.num_attention_heads=2",
        "model.tiny.intermediate_size=64",
    ]
    metrics = run(compose([*args, f"data.sft.source={good}"], tmp_path / "run"))
    assert 0 < metrics["train/loss"] < 100
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "run" / "policy").chat_template == tok.chat_template
    )  # later stages alike
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:17: message 0 is assistant, expected user"):
        run(compose([*args, f"data.sft.source={bad}"], tmp_path / "run2"))


def test_rollouts_stop_at_the_templates_end_of_turn(chat_tokenizer):
    from lit_rlhf.rollout.collect import stop_token_ids

    kind, tok = chat_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>" if kind == "chatml" else "<|eot_id|>")
    assert stop_token_ids(tok) == [tok.eos_token_id, end]
