"""The shipped verifiable rewards (lit_rlhf/rewards, docs/rewards.md) on hand-written cases: answer
extraction, math-verify equivalence, the error count, format and exact match."""

from __future__ import annotations

import threading

import math_verify
import pytest

from lit_rlhf.rewards import (
    MathAccuracy,
    answer_after_prefix,
    clean_answer,
    exact_match,
    extract_final_answer,
    format_reward,
    last_boxed,
    math_accuracy,
    reference_answer,
)
from lit_rlhf.utils.config import ConfigError


@pytest.fixture(scope="module")
def accuracy():
    return math_accuracy()


def score(fn, responses, answers=None, **columns):
    """``fn`` called the way the RL stage calls it, on one response per ground truth."""
    n = len(responses)
    if answers is not None:
        columns["answer"] = answers
    return fn(["prompt"] * n, responses, [True] * n, **columns)


# --- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so it is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),  # nested braces
        (r"\boxed{\left\{1, 2\right\}}", r"\left\{1, 2\right\}"),  # escaped braces are not nesting
        (r"\boxed{7} and then \boxed{\frac{1}{", "7"),  # a truncated last box: the one before it
        (r"\boxed{ $5$ }", "5"),
        (r"#### 99 but \boxed{3}", "3"),  # boxed wins over ####
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,234\nmore text 5", "1,234"),  # the rest of the ####-line, not the last number
        ("#### 10\n#### 12", "12"),
        ("#### 10 #### 12", "12"),  # the last marker, even on one line
        ("The answer is 18. Then 19 more", "18"),
        ("the ANSWER is: **42**", "42"),
        ("So the final answer is 3.5.", "3.5"),  # a '.' inside a number does not end the sentence
        ("The answer is $\\frac{1}{2}$.\nCheck: 0.5", "\\frac{1}{2}"),
        ("The answer is 18 apples! Yes 3", "18"),  # a number followed by words is the number
        ("The answer is 4 and the answer is 5.", "5"),  # the last one
        ("The answer is\n42", "42"),  # an empty span falls through (to the last number)
        ("I got 3 apples, then 7", "7"),
        ("the temperature fell to -5", "-5"),
        ("5-3 is 2, and 5-3", "3"),  # a '-' after a digit is not a sign
        ("it costs 1,234 dollars", "1,234"),
        ("-1,234,567.25 in total", "-1,234,567.25"),
        ("half is 3/4 of it", "3/4"),
        ("values 1,2,3", "3"),  # not a thousands group
        ("pi is 3.14", "3.14"),
        ("no number here", None),
        ("", None),
        # the region: after </think>, inside the last closed <answer>
        (r"<think>so \boxed{3}</think> <answer>5</answer>", "5"),
        ("<think>3 + 4 = 7, so 7", None),  # never left the reasoning
        ("</think> 12", "12"),
        ("<answer>1</answer> <answer>2</answer> 3", "2"),
        ("<answer>7 oranges</answer>", "7"),
        ("<answer>12", "12"),  # an unclosed tag is not a region
        ("<answer></answer> 3", None),  # an empty answer is no answer
        # the last math span, and numbers that do not stand alone
        (r"so $x = \frac{3}{4}$.", r"x = \frac{3}{4}"),
        (r"$$y = 2$$ at the end", "y = 2"),
        ("He paid $5 and got $3 back, so $2", "2"),  # dollars pair up; the number after them wins
        (r"so x is \frac{3}{4}", None),
        (r"\frac{1+\sqrt5}{2}", None),
        ("x lies in [0,1)", None),
        ("(3+4)", None),
        ("it is 5 (which is odd)", "5"),
        ("(which is 5)", "5"),
        ("so x^2", None),
        ("H2", None),
        ("it is 28%", "28"),
        # numbers as written
        ("it is \u22125", "-5"),
        ("it is .4", ".4"),
        (r"in total 1\,000", r"1\,000"),
        (r"costs \$5", "5"),
        # where an answer span ends
        ("the answer is 5 dollars.", "5"),
        ("the answer is 5 or 6.", "5 or 6"),
        # boxes
        (r"\boxed{\boxed{3}}", "3"),
        (r"\boxed{a}\boxed{b", "a"),
        (r"\fbox{12}", "12"),
        (r"\boxed{1} }} \boxed{2}", "2"),  # stray closers before a box do not matter
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def _last_boxed_by_rescanning(text: str) -> str | None:
    """An independent reference for last_boxed: from each box's "{", scan forward until it closes,
    trying the boxes from the last one back (quadratic, the obvious algorithm)."""
    import re

    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{" and text[i - 1] != "\\":
                depth += 1
            elif text[i] == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def test_last_boxed_agrees_with_rescanning_on_random_text():
    import random

    rng = random.Random(0)
    pieces = ["\\boxed{", "\\fbox {", "{", "}", "\\{", "\\}", "x", "1", " ", "\\frac"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert last_boxed(text) == _last_boxed_by_rescanning(text), text


def test_clean_prefix_and_reference():
    assert clean_answer(" **$18$**. ") == "18"
    assert clean_answer("3.5") == "3.5"
    assert answer_after_prefix("reasoning\nanswer: 41\nno wait\nAnswer: 42 \nbye", "answer:") == "42"
    assert answer_after_prefix("the result is 42", "answer:") is None
    assert answer_after_prefix("answer:", "answer:") == ""
    assert reference_answer("Natalia sold 48/2 = 24 clips...\n#### 72") == "72"
    assert reference_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"


# --- math_accuracy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
        ("it is 1/2", r"\frac{1}{2}", 1.0),
        ("Natalia sold 24 in May.\n#### 72", "72", 1.0),
        ("The answer is 18.", "18", 1.0),
        ("The answer is 18 apples.", "18", 1.0),
        ("The answer is 17.", "18", 0.0),  # wrong
        ("first 3, then finally 7", "7", 1.0),  # last-number fallback
        ("first 7, then finally 3", "7", 0.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),  # nested braces
        (r"\boxed{\frac{3}{4}}", "3/4", 1.0),
        ("the temperature is -5 degrees", "-5", 1.0),  # negatives
        ("it went 5 and ended at -5", "5", 0.0),
        ("in total 1,234", "1234", 1.0),  # thousands separators
        ("in total 1234", "1,234", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        ("She pays $18.00.", "18", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
        (r"\boxed{\dfrac{1}{2}}", "$0.5$", 1.0),  # $…$ around the ground truth
        ("steps... #### 42", "She earns 6 * 7 = 42.\n#### 42", 1.0),  # GSM8K-form ground truth
        ("steps... #### 41", "She earns 6 * 7 = 42.\n#### 42", 0.0),
        ("I do not know", "5", 0.0),  # no number: 0.0, not an error
    ],
)
def test_math_accuracy_cases(accuracy, response, truth, expected):
    assert score(accuracy, [response], [truth]) == [expected]
    assert accuracy.last_errors == 0 and accuracy.last_error_example is None


def test_math_accuracy_batch_in_order_and_ignores_other_columns(accuracy):
    out = score(
        accuracy, [r"\boxed{2}", "#### 3", "The answer is 4."], ["2", "4", "4"], level=["easy"] * 3, source=[1, 2, 3]
    )
    assert out == [1.0, 0.0, 1.0]


def test_a_missing_ground_truth_scores_zero_and_is_counted(accuracy):
    assert score(accuracy, [r"\boxed{2}", r"\boxed{2}", r"\boxed{3}"], ["2", None, None]) == [1.0, 0.0, 0.0]
    assert accuracy.last_errors == 2
    assert accuracy.last_error_example.startswith("response 1: MissingAnswerError")
    score(accuracy, [r"\boxed{2}"], ["2"])  # the count is the last call's
    assert accuracy.last_errors == 0 and accuracy.last_error_example is None


def test_an_unparseable_ground_truth_is_counted(accuracy):
    assert score(accuracy, ["#### 3", "#### 3"], ["3", "#### "]) == [1.0, 0.0]
    assert accuracy.last_errors == 1 and "GroundTruthParseError" in accuracy.last_error_example


def test_a_verifier_that_raises_on_one_response_scores_it_zero_and_goes_on(accuracy, monkeypatch):
    real = math_verify.verify

    def flaky(gold, target, **kwargs):
        if any("13" in str(t) for t in target):
            raise RuntimeError("sympy fell over")
        return real(gold, target, **kwargs)

    monkeypatch.setattr(math_verify, "verify", flaky)
    out = score(accuracy, [r"\boxed{12}", r"\boxed{13}", r"\boxed{14}"], ["12", "13.0", "15"])
    assert out == [1.0, 0.0, 0.0]
    assert accuracy.last_errors == 1
    assert accuracy.last_error_example == "response 1: RuntimeError: sympy fell over"


def test_a_math_verify_timeout_is_counted_in_the_main_thread():
    fn = math_accuracy(timeout_seconds=1)
    assert score(fn, [r"\boxed{10^{10^{10}}}", r"\boxed{5}"], ["5", "5"]) == [0.0, 1.0]
    assert fn.last_errors == 1 and "TimeoutException" in fn.last_error_example


def test_math_accuracy_runs_outside_the_main_thread(accuracy):
    # math-verify's signal.alarm timeout would raise there; the reward switches it off instead
    out, seen = {}, {}

    def work():
        out["scores"] = score(accuracy, [r"\boxed{\frac{1}{2}}", "#### 3"], ["0.5", "4"])
        seen["timeout"] = accuracy._timeout()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert out["scores"] == [1.0, 0.0] and accuracy.last_errors == 0
    assert seen["timeout"] is None and accuracy._timeout() == 5


def test_math_accuracy_needs_the_answer_column(accuracy):
    with pytest.raises(ValueError, match="needs the ground truth"):
        score(accuracy, ["#### 3"])
    with pytest.raises(ValueError, match="2 answers for 1 responses"):
        score(accuracy, ["#### 3"], ["3", "4"])


@pytest.mark.parametrize("bad", [0, -1, 1.5, "5", True])
def test_math_accuracy_bad_timeout_names_the_key(bad):
    with pytest.raises(ConfigError) as err:
        math_accuracy(timeout_seconds=bad)
    assert err.value.key == "timeout_seconds"


def test_math_accuracy_without_math_verify_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lit_rlhf\[verify\]'"):
        math_accuracy()


def test_the_factories_return_callables_with_the_error_attributes():
    for fn in (math_accuracy(), format_reward(), exact_match()):
        assert callable(fn) and fn.last_errors == 0 and fn.last_error_example is None
    assert isinstance(math_accuracy(timeout_seconds=None), MathAccuracy)


# --- format_reward ----------------------------------------------------------------------------


def test_format_reward_default_pattern():
    fn = format_reward()
    responses = [
        "<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>",  # DOTALL: the reasoning spans lines
        "  <think>x</think><answer>42</answer>\n",  # surrounding whitespace is stripped
        "<think>x</think> <answer>42</answer> trailing",  # not the whole response
        "<answer>42</answer>",
        "<think>x</think>",
        "",
    ]
    assert fn(["p"] * 6, responses, [True] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert fn.last_errors == 0


def test_format_reward_custom_pattern_reads_no_answer():
    fn = format_reward(pattern=r"answer: \d+")
    # the whole response must match; the answer column (even None) is not read
    assert score(fn, ["answer: 42", "answer: 42 and more", "ANSWER: 42"], [None, "1", None]) == [1.0, 0.0, 0.0]
    assert fn.last_errors == 0


@pytest.mark.parametrize("bad", ["(unclosed", "[a-", 42])
def test_format_reward_bad_pattern_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="^pattern: ") as err:
        format_reward(pattern=bad)
    assert err.value.key == "pattern"


# --- exact_match ------------------------------------------------------------------------------


def test_exact_match_default_uses_the_extraction_chain():
    fn = exact_match()
    responses = [
        r"\boxed{42}",
        "#### 42",
        "The answer is 42.",
        "so 41 or 42",
        "The answer is 42 apples.",
        r"\boxed{\frac{1}{2}}",
        "in total 1,234",
        "no number",
    ]
    answers = ["42", " 42 ", "steps\n#### 42", "42", "42", "0.5", "1234", "42"]
    assert score(fn, responses, answers) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert fn.last_errors == 0


def test_exact_match_casefold():
    responses = ["The answer is Paris.", "the answer is PARIS"]
    assert score(exact_match(), responses, ["paris", "paris"]) == [0.0, 0.0]
    assert score(exact_match(normalize="casefold"), responses, ["paris", "paris"]) == [1.0, 1.0]


def test_exact_match_answer_prefix_reads_only_the_last_prefixed_line():
    fn = exact_match(answer_prefix="answer:")
    responses = [
        "7 * 6 = 42\nanswer: 42",
        "answer: 41\nwait, 7 * 6 = 42\nAnswer: 42\n",  # the last occurrence, case-insensitive
        "answer: 42 \nbut I think 43",  # to the end of that line only
        "the result is 42",  # no prefix: no fallback to the other rules
        "answer: 43",
    ]
    assert score(fn, responses, ["42"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert score(fn, ["answer: 42"], [None]) == [0.0]
    assert fn.last_errors == 1 and "MissingAnswerError" in fn.last_error_example


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"normalize": "lower"}, "normalize"),
        ({"answer_prefix": " "}, "answer_prefix"),
        ({"answer_prefix": 3}, "answer_prefix"),
    ],
)
def test_exact_match_bad_options_name_their_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        exact_match(**kwargs)
    assert err.value.key == key


# --- as algo.reward_fns entries ---------------------------------------------------------------


def test_the_factories_pass_the_reward_spec_check_and_build_through_hydra():
    from hydra.utils import instantiate

    from lit_rlhf.modules.configs import check_reward_specs

    specs = [
        {"_target_": "lit_rlhf.rewards.math_accuracy", "name": "accuracy", "weight": 1.0, "timeout_seconds": 3},
        {"_target_": "lit_rlhf.rewards.format_reward", "name": "format", "weight": 0.1, "pattern": r"answer: \d+"},
        {"_target_": "lit_rlhf.rewards.exact_match", "answer_prefix": "answer:", "normalize": "casefold"},
    ]
    check_reward_specs(None, specs, None)
    fns = [instantiate({k: v for k, v in s.items() if k not in ("name", "weight")}) for s in specs]
    assert [score(fn, ["answer: 42"], ["42"]) for fn in fns] == [[1.0], [1.0], [1.0]]
    with pytest.raises(ConfigError, match=r"reward_fns\[0\]\.timeout: unknown argument of math_accuracy"):
        check_reward_specs(None, [{"_target_": "lit_rlhf.rewards.math_accuracy", "timeout": 3}], None)
