"""Rollout.columns (the rows' ground truth) follow their rows through select and cat_rollouts."""

import pytest
import torch

from lit_rlhf.core.types import Rollout, cat_rollouts


def rollout(n, prompt_width, answers):
    return Rollout(
        prompt_ids=torch.ones(n, prompt_width, dtype=torch.long),
        prompt_mask=torch.ones(n, prompt_width),
        response_ids=torch.zeros(n, 2, dtype=torch.long),
        response_mask=torch.ones(n, 2),
        ended=torch.ones(n, dtype=torch.bool),
        scores=torch.arange(n, dtype=torch.float32),
        prompts_text=[f"p{a}" for a in answers],
        responses_text=["r"] * n,
        columns={"answer": list(answers)},
    )


def test_select_and_cat_keep_each_rows_answer():
    a, b = rollout(3, 2, ["7", "8", "9"]), rollout(2, 4, ["1", "2"])
    picked = a.select(torch.tensor([2, 0]))
    assert picked.columns == {"answer": ["9", "7"]} and picked.prompts_text == ["p9", "p7"]
    both = cat_rollouts([picked, b], pad_id=0)
    assert both.columns == {"answer": ["9", "7", "1", "2"]}
    assert [f"p{x}" for x in both.columns["answer"]] == both.prompts_text
    assert cat_rollouts([rollout(1, 1, ["5"]), rollout(1, 1, ["6"])], 0).columns["answer"] == ["5", "6"]


def test_rollouts_with_different_columns_do_not_concatenate():
    other = rollout(1, 2, ["1"])
    other.columns = {}
    with pytest.raises(ValueError, match="their columns differ"):
        cat_rollouts([rollout(1, 2, ["3"]), other], pad_id=0)
