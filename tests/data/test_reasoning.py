"""The embedded reasoning task (lit_rlhf/data/reasoning.py): problems, solver, teacher, checker,
splits and tokenizer against hand-written cases; its data modules hand each prompt's answer to the
rewards."""

from __future__ import annotations

import collections
import re

import pytest

from lit_rlhf.data.reasoning import (
    ReasoningTask,
    ReasoningTaskConfig,
    answer_reward_fn,
    apply,
    build_tokenizer,
    format_reward_fn,
    parse_answer,
)
from lit_rlhf.rewards import exact_match
from lit_rlhf.utils.config import ConfigError


@pytest.fixture(scope="module")
def task():
    return ReasoningTask()


def test_arithmetic_is_modular_left_to_right(task):
    assert apply(7, "+", 5, 10) == 2
    assert apply(2, "-", 3, 10) == 9
    assert apply(3, "*", 4, 10) == 2
    assert apply(6, "+", 9, 7) == 1
    assert task.solve("7 + 5 - 3 =") == "9"  # (7 + 5) % 10 = 2, (2 - 3) % 10 = 9
    assert task.solve("1 - 2 - 3 + 9 =") == "5"  # 9, 6, 15 % 10
    assert task.correct_solution("7 + 5 - 3 =") == "7 + 5 = 2 ; 2 - 3 = 9 ; answer: 9"


@pytest.mark.parametrize("bad", ["7 + =", "7 5 =", "12 + 3 =", "7 * 3 =", "7 + 3", "", "+ 3 ="])
def test_a_prompt_outside_the_task_is_refused(task, bad):
    # "12" is not a number below the modulus; "*" is not among the default operators ("+-")
    with pytest.raises(ValueError, match="not a problem of the reasoning task"):
        task.parse(bad)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("7 + 5 = 2 ; answer: 2", "2"),
        ("answer: 13", "13"),
        ("7 + 5 = 2 ; answer: 2 ;", None),  # something after the answer
        ("answer: 2 answer: 2", None),  # two answer lines
        ("7 + 5 = 2 ;", None),  # no answer line
        ("answer:", None),
    ],
)
def test_parse_answer(response, answer):
    assert parse_answer(response) == answer


def test_checker_and_rewards_agree_with_hand_written_cases(task):
    prompts = ["7 + 5 - 3 ="] * 5
    responses = [
        "7 + 5 = 2 ; 2 - 3 = 9 ; answer: 9",  # right, well-formed
        "7 + 5 = 3 ; 3 - 3 = 0 ; answer: 0",  # a wrong step: wrong answer, still well-formed working
        "7 + 5 = 2 ; 2 - 3 = 9 ; answer: 8",  # the answer line does not repeat the last result
        "answer: 9",  # right answer without the working
        "7 + 5 = 2 ; 2 - 3 = 9 ; answer: 9",  # right but cut (no EOS)
    ]
    ended = [True, True, True, True, False]
    assert answer_reward_fn()(prompts, responses, ended) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert format_reward_fn()(prompts, responses, ended) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # the shipped exact-match verifier reads the same answer line against the data's answer column
    em = exact_match(answer_prefix="answer:")
    assert em(prompts, responses, ended, answer=["9"] * 5) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_well_formed_checks_the_copy_of_the_prompt(task):
    assert task.well_formed("7 + 5 - 3 =", "7 + 5 = 4 ; 4 - 3 = 1 ; answer: 1")
    assert not task.well_formed("7 + 5 - 3 =", "7 + 5 = 4 ; 4 + 3 = 7 ; answer: 7")  # operator changed
    assert not task.well_formed("7 + 5 - 3 =", "7 + 5 = 4 ; 2 - 3 = 9 ; answer: 9")  # left operand not carried
    assert not task.well_formed("7 + 5 - 3 =", "7 + 5 = 2 ; answer: 2")  # a step missing
    assert not task.well_formed("7 + 5 - 3 =", "7 + 5 = 2 ; 2 - 3 = 19 ; answer: 19")  # not below the modulus
    assert not task.well_formed("not a problem", "answer: 1")


def test_hard_facts_and_the_teacher_error_rate():
    task = ReasoningTask(ReasoningTaskConfig(teacher_error=0.65, hard_fraction=0.2))
    facts = task.facts
    assert len(facts) == 2 * 10 * 10  # "+-" over 0..9 x 0..9
    hard = task.hard_facts
    assert len(hard) == 40  # round(0.2 x 200)
    assert all(wrong != (a + b if op == "+" else a - b) % 10 for (a, op, b), wrong in hard.items())
    # count, from the records' own text, how often each kind of step is written right
    written = collections.Counter()
    for rec in task.sft_records(4000):
        tokens = rec["response"].split()
        for i in range(0, len(tokens) - 2, 6):
            a, op, b, c = int(tokens[i]), tokens[i + 1], int(tokens[i + 2]), int(tokens[i + 4])
            right = (a + b if op == "+" else a - b) % 10
            kind = "hard" if (a, op, b) in hard else "easy"
            written[kind, "right" if c == right else ("teacher" if c == hard.get((a, op, b)) else "other")] += 1
    assert written["easy", "teacher"] == written["easy", "other"] == written["hard", "other"] == 0
    n_hard = written["hard", "right"] + written["hard", "teacher"]
    share = written["hard", "teacher"] / n_hard
    assert n_hard > 2000
    assert abs(share - 0.65) < 4 * (0.65 * 0.35 / n_hard) ** 0.5  # binomial: 4 standard errors
    # the answer line always repeats the last written result
    for rec in task.sft_records(50):
        tokens = rec["response"].split()
        assert tokens[-2:] == ["answer:", tokens[-4]] and tokens[-3] == ";"


def test_teacher_without_errors_writes_the_correct_solutions():
    task = ReasoningTask(ReasoningTaskConfig(teacher_error=0.0))
    recs = task.sft_records(200)
    assert all(r["response"] == task.correct_solution(r["prompt"]) for r in recs)


def test_splits_are_disjoint_and_the_data_is_deterministic():
    task = ReasoningTask()
    test = {r["prompt"] for r in task.qa_records(300, "test")}
    val = {r["prompt"] for r in task.qa_records(300, "val")}
    assert len(test) == 300 and len(val) == 300  # held-out problems are distinct
    train = {r["prompt"] for r in task.sft_records(5000)} | {r["prompt"] for r in task.qa_records(5000)}
    assert not (test & train) and not (val & train) and not (test & val)
    assert all(task.split_of(p) == "test" for p in test)
    # the split is a hash of the text: about 5% of all problems are test, 5% val
    pool = [r["prompt"] for r in task.sft_records(4000)]  # training draws only: count the hash on fresh strings
    counts = collections.Counter(task.split_of(p.replace("=", "+ 0 =")) for p in pool)
    assert 0.03 < counts["test"] / len(pool) < 0.07 and 0.03 < counts["val"] / len(pool) < 0.07
    assert task.qa_records(50, "test") == ReasoningTask().qa_records(50, "test")
    assert task.sft_records(50) == ReasoningTask().sft_records(50)
    assert task.sft_records(50) != ReasoningTask(ReasoningTaskConfig(seed=7)).sft_records(50)
    # every answer is the solver's
    assert all(r["answer"] == task.solve(r["prompt"]) for r in task.qa_records(100, "val"))
    steps = collections.Counter(len(r["prompt"].split()) // 2 - 1 for r in task.qa_records(600))
    assert set(steps) == {2, 3, 4}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("operators", "+/", re.escape("operators: must be distinct characters of '+-*', got '+/'")),
        ("operators", "++", "operators: must be distinct"),
        ("max_steps", 1, "max_steps: must be >= min_steps=2"),
    ],
)
def test_bad_task_config_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        ReasoningTask(ReasoningTaskConfig(**{key: value}))


def test_tokenizer_covers_every_token_of_the_task(task):
    tok = build_tokenizer()
    text = "7 + 5 = 2 ; 2 - 3 = 9 ; answer: 9"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert len(ids) == 1 + len(text.split())  # word level: one id per word
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id not in tok("19 * 0 =")["input_ids"]  # every modulus and operator


def test_data_modules_read_the_task_with_answers():
    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.sft import SFTDataModule

    tok = build_tokenizer()
    sft = SFTDataModule(source="reasoning", n_train=64, n_val=16, max_length=48, batch_size=8).connect(tok)
    sft.setup()
    assert sft.stats["train_pairs"] == 64 and sft.stats["val_pairs"] == 16
    batch = next(iter(sft.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8
    prompts = PromptDataModule(source="reasoning", n_train=32, n_val=8, batch_size=4, reasoning={"modulus": 7})
    prompts.connect(tok).setup()
    task = ReasoningTask(ReasoningTaskConfig(modulus=7))
    for loader in (prompts.train_dataloader(), prompts.val_dataloader()):
        batch = next(iter(loader))
        assert batch["columns"]["answer"] == [task.solve(p) for p in batch["prompts"]]
    assert len(prompts.val_set) == 8


def test_preference_data_from_the_reasoning_task_is_refused():
    from lit_rlhf.data.configs import PreferenceDataConfig

    with pytest.raises(ConfigError, match="source: the reasoning task has no preference pairs"):
        PreferenceDataConfig(source="reasoning").validate()
