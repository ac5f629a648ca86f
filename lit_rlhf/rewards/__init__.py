"""Reward callables for RL with verifiable rewards (GRPO/DAPO on math), for ``algo.reward_fns``
(docs/rewards.md): ``{_target_: lit_rlhf.rewards.math_accuracy, name: accuracy, weight: 1.0}``.

Each ``_target_`` is a factory; the callable it returns is called as
``fn(prompts, responses, ended, answer=[...], **other_columns) -> list[float]`` and keeps the error
count of its last call in ``last_errors`` (first message: ``last_error_example``).
Rewards scored elsewhere (docs/remote_rewards.md): :class:`RemoteReward` (a reward-model server,
``lit_rlhf.serve``), :class:`LLMJudge` (an OpenAI-compatible chat endpoint) and :class:`PerResponse`
(a user's per-response ``async def``) are awaited concurrently while the rollout's forwards run.
Multi-turn trajectories (docs/agents.md): :func:`environment_reward` and :func:`tool_call_cost` read
the columns the rollout adds. Importing this package is cheap: math-verify loads when
``math_accuracy`` builds its reward, aiohttp with the first remote call.
"""

from lit_rlhf.rewards.agent import environment_reward, tool_call_cost
from lit_rlhf.rewards.base import MissingAnswerError, VerifiableReward
from lit_rlhf.rewards.concurrent import PerResponse
from lit_rlhf.rewards.extract import (
    answer_after_prefix,
    answer_region,
    clean_answer,
    extract_final_answer,
    last_boxed,
    reference_answer,
)
from lit_rlhf.rewards.http import RemoteRewardError, RewardServiceDown
from lit_rlhf.rewards.judge import LLMJudge
from lit_rlhf.rewards.math_reward import GroundTruthParseError, MathAccuracy, math_accuracy, math_text
from lit_rlhf.rewards.remote import RemoteReward
from lit_rlhf.rewards.text import ExactMatch, FormatReward, exact_match, format_reward

__all__ = [
    "ExactMatch",
    "FormatReward",
    "GroundTruthParseError",
    "LLMJudge",
    "MathAccuracy",
    "MissingAnswerError",
    "PerResponse",
    "RemoteReward",
    "RemoteRewardError",
    "RewardServiceDown",
    "VerifiableReward",
    "answer_after_prefix",
    "answer_region",
    "clean_answer",
    "environment_reward",
    "exact_match",
    "extract_final_answer",
    "format_reward",
    "last_boxed",
    "math_accuracy",
    "math_text",
    "reference_answer",
    "tool_call_cost",
]
