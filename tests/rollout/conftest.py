"""Fixtures of the rollout tests."""

import pytest
import torch

from lit_rlhf.models.builders import build_causal_lm


@pytest.fixture
def policy(tiny_spec, tokenizer):
    torch.manual_seed(0)
    return build_causal_lm(tiny_spec, tokenizer)
