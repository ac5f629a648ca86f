"""Rewards of multi-turn trajectories (docs/agents.md §4), read from the columns the rollout adds
to each trajectory: ``env_reward`` (the environment's own reward: a game's step rewards, a tool
environment's ``reward()``), ``tool_calls`` and ``turns``. For ``algo.reward_fn`` / ``algo.reward_fns``::

    reward_fns:
      - {_target_: lit_rlhf.rewards.exact_match, name: accuracy}
      - {_target_: lit_rlhf.rewards.tool_call_cost, cost: 0.05, name: call_cost}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lit_rlhf.utils.config import ConfigError


def environment_reward() -> Callable[..., list[float]]:
    """The environment's reward of each trajectory (NaN where its ``step`` or ``reward()`` failed:
    the row is left out of the update, never scored 0). Without an environment (no ``env_reward``
    column) it refuses to score."""

    def reward(prompts: Sequence[Any], responses: Sequence[str], ended: Sequence[bool], env_reward=None) -> list[float]:
        if env_reward is None:
            raise ValueError(
                "environment_reward reads the env_reward column of a multi-turn rollout: set algo.environment"
            )
        return [float(r) for r in env_reward]

    return reward


def tool_call_cost(cost: float = 0.05) -> Callable[..., list[float]]:
    """−``cost`` per tool call of each trajectory (add it to a task reward: calls that do not pay
    for themselves are unlearned)."""
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not math.isfinite(cost) or cost < 0:
        raise ConfigError("cost", f"must be a finite number >= 0, got {cost!r}")

    def reward(prompts: Sequence[Any], responses: Sequence[str], ended: Sequence[bool], tool_calls=None) -> list[float]:
        if tool_calls is None:
            raise ValueError("tool_call_cost reads the tool_calls column of a multi-turn rollout: set algo.environment")
        return [-cost * float(n) for n in tool_calls]

    return reward
