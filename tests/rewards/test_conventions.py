"""math_accuracy's conventions as a table (docs/rewards.md §1–§2): each case with where its expectation
comes from. A case whose source is math-verify is also checked against plain math-verify (``parse`` of
the whole response and of the gold — in ``$…$`` when it finds nothing bare — then ``verify``, as TRL's
``accuracy_reward`` calls it), so the
table cannot claim an agreement that does not hold; a case where lit_rlhf decides otherwise says so
and why."""

from __future__ import annotations

import json

import math_verify
import pytest

from lit_rlhf.rewards import extract_final_answer, math_accuracy
from tests.conftest import ROOT

MV = "math-verify 0.9.0"  # checked against plain math-verify below
R1 = "DeepSeek-R1 (arXiv:2501.12948): reasoning in <think>, the answer in <answer>"
RLLM = "rllm's math reward: the answer is read after </think>, none without it"
MATH = "MATH (Hendrycks et al. 2021): the answer is the last \\boxed{}"
GSM8K = "GSM8K (Cobbe et al. 2021): the answer follows ####"
OURS = "lit_rlhf convention (docs/rewards.md)"

# (response, ground truth, score, source, why — for a case where plain math-verify differs)
CASES = [
    # percents: a percent is its number (math-verify reads 28\% as 28/100 on one side only)
    ("28 %", "28\\%", 1.0, MV, None),
    ("it is 28 percent", "28\\%", 1.0, MV, None),
    ("\\boxed{28}", "28\\%", 1.0, MV, None),
    ("\\boxed{50 \\%}", "50\\%", 1.0, OURS, "math-verify keeps '50 \\%' in a box as a string: 0"),
    ("\\boxed{28\\%}", "28", 1.0, OURS, "math-verify keeps a boxed '28\\%' as a string: 0"),
    ("the answer is 0.28", "28\\%", 0.0, MV, None),
    # the last-number fallback does not read inside LaTeX or brackets
    ("so x is \\frac{3}{4}", "4", 0.0, MV, None),
    ("the ratio is \\frac{1+\\sqrt5}{2}", "2", 0.0, OURS, "a bare LaTeX expression is not a number"),
    ("x lies in [0,1)", "1", 0.0, OURS, "the endpoint of an interval is not the answer"),
    ("we get $\\frac{3}{4}$.", "0.75", 1.0, MV, None),
    ("we get $\\frac{3}{4}$.", "4", 0.0, MV, None),
    ("$x = 2$ so 3 apples", "3", 1.0, OURS, "a number after the last math span is the answer"),
    # <think> and <answer>
    ("<think>maybe \\boxed{3}</think>\n<answer>5</answer>", "5", 1.0, R1, None),
    ("<think>maybe \\boxed{3}</think>\n<answer>5</answer>", "3", 0.0, R1, None),
    ("<think>\n3 + 4 = 7\n</think>\nThe answer is 7.", "7", 1.0, RLLM, None),
    ("<think>\n3 + 4 = 7, so 7", "7", 0.0, RLLM, None),  # never left the reasoning (truncated)
    ("</think> so \\boxed{7}", "7", 1.0, RLLM, None),  # the template opened <think>
    ("<answer>\\frac{3}{4}</answer>", "0.75", 1.0, R1, None),
    ("<answer>x = 5</answer>", "5", 1.0, R1, None),
    ("<answer>12 apples</answer>", "12", 1.0, OURS, "a number followed by words is the number"),
    ("<answer>5 or 6</answer>", "5", 0.0, OURS, "two answers are not one: no credit for hedging"),
    ("<answer>the answer is \\boxed{9}</answer> 10", "9", 1.0, R1, None),
    # where an answer span ends
    ("the answer is 5 dollars.", "5", 1.0, MV, None),
    ("The answer is 18 apples! Then 19", "18", 1.0, OURS, "the sentence ends at '!'; its words are units"),
    ("the answer is 5 or 6.", "5", 0.0, OURS, "no credit for hedging"),
    ("#### 72 dollars", "72", 1.0, GSM8K, None),
    # which box
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0, MATH, None),
    ("\\boxed{7} and then \\boxed{\\frac{1}{", "7", 1.0, MATH, None),
    ("\\fbox{12}", "12", 1.0, OURS, "math-verify reads no \\fbox outside $…$"),
    # numbers as written
    ("it is .4", "0.4", 1.0, MV, None),
    ("in total 1\\,000", "1000", 1.0, OURS, "math-verify reads 1\\,000 as 1*0"),
    ("\\boxed{1{,}000}", "1000", 1.0, OURS, "LaTeX's thousands comma"),
    ("it is \u22125", "-5", 1.0, OURS, "math-verify finds nothing outside math in '\u22125'"),
    ("\\boxed{\u22125}", "-5", 1.0, MV, None),
    ("She pays \\$18.", "18", 1.0, OURS, "math-verify finds nothing in '\\$18'"),
    # text golds and things sympy cannot read
    ("\\boxed{12:00}", "12:00", 1.0, OURS, "math-verify with raise_on_error=True raised here"),
    ("The answer is forty two.", "forty two", 1.0, OURS, "a words gold is compared as text"),
    ("The answer is two forty.", "forty two", 0.0, OURS, "as symbols both were the product f*o*r*t*y*t*w*o"),
    ("\\boxed{\\text{Paris}}", "paris", 1.0, OURS, "words, case-insensitive"),
    ("\\boxed{B}", "B", 1.0, MV, None),
    ("\\boxed{C}", "B", 0.0, MV, None),
    # equivalence is math-verify's
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, MV, None),
    ("\\boxed{x = 3}", "3", 1.0, MV, None),
    ("\\boxed{[0,1)}", "[0,1)", 1.0, MV, None),
    ("\\boxed{\\sqrt{8}}", "$2\\sqrt{2}$", 1.0, MV, None),
]


@pytest.fixture(scope="module")
def accuracy():
    return math_accuracy()


@pytest.mark.parametrize("response, truth, expected, source, why", CASES)
def test_math_accuracy_convention(accuracy, response, truth, expected, source, why):
    assert accuracy(["p"], [response], [True], answer=[truth]) == [expected], source
    assert accuracy.last_errors == 0, accuracy.last_error_example
    gold = math_verify.parse(truth) or math_verify.parse(f"${truth}$")  # a bare LaTeX gold as math
    plain = float(math_verify.verify(gold, math_verify.parse(response)))
    if source == MV:
        assert plain == expected, "plain math-verify disagrees: this case is not math-verify's"
    elif why is not None and why.startswith("math-verify"):
        assert plain != expected, f"the stated difference from math-verify ({why}) does not hold"


def test_several_acceptable_answers_score_the_best(accuracy):
    out = accuracy(["p"] * 3, ["\\boxed{5}", "\\boxed{10}", "\\boxed{7}"], [True] * 3, answer=[["5", "10"]] * 3)
    assert out == [1.0, 1.0, 0.0] and accuracy.last_errors == 0
    assert accuracy(["p"], ["\\boxed{5}"], [True], answer=[("5",)]) == [1.0]
    assert accuracy(["p"], ["\\boxed{5}"], [True], answer=[[]]) == [0.0]
    assert accuracy.last_errors == 1 and "MissingAnswerError" in accuracy.last_error_example


def test_many_unclosed_boxes_still_find_the_last_closed_one(accuracy):
    # extraction time on such responses is measured in bench/run.py (extraction), not here
    response = "\\boxed{" * 2000 + " so \\boxed{42}"
    assert accuracy(["p"], [response], [True], answer=["42"]) == [1.0]


def _doc_rows(section: str) -> list[list[str]]:
    """The table rows of docs/rewards.md's ``section`` (its heading's text), cells as written."""
    text = (ROOT / "docs" / "rewards.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in body.splitlines() if line.startswith("| `")]
    assert rows, section
    return rows


def _code(cell: str) -> str:
    """A cell's text: the first `code` span of each line, lines joined at ⏎ (the docs' newline)."""
    return "\n".join(part.split("`")[1] if "`" in part else part for part in cell.split("⏎"))


def test_the_extraction_table_of_the_docs_holds():
    for response, extracted in _doc_rows("1. Final-answer extraction"):
        want = _code(extracted.strip())
        assert extract_final_answer(_code(response)) == (None if want == "None" else want), response


def test_the_math_accuracy_table_of_the_docs_holds(accuracy):
    for response, truth, result in _doc_rows("2. `math_accuracy`"):
        gold = _code(truth)
        gold = None if gold == "None" else json.loads(gold) if gold.startswith("[") else gold
        assert accuracy(["p"], [_code(response)], [True], answer=[gold]) == [float(result[:3])], response
        assert accuracy.last_errors == (1 if "counted" in result else 0), response
