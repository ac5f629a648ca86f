"""Multi-turn RL through train.py's path (lit_rlhf.launch.runner.run on the composed config): GRPO and
PPO-max on the reasoning task with the calculator (experiment=grpo_agent_tiny) from the session's
tiny policy that writes calls (tests/conftest.py ``agent_policy_dir``), a few iterations with a
checkpoint after each; a resume from the second checkpoint ends exactly where the uninterrupted run
ends; and the multi-turn metrics are logged."""

from __future__ import annotations

import csv

import pytest

from lit_rlhf.launch.runner import run
from tests.conftest import compose
from tests.test_resume import EVERY_BATCH, assert_same_end, load

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("agent_runs")]


def overrides(stage: str, policy) -> list[str]:
    algo = {
        "grpo": ["algo.num_generations=4"],
        "ppo_max": ["algo=ppo_max", "algo.minibatch_size=4"],
        "remax": ["algo=remax"],
        "grpo_vllm": [
            "algo.num_generations=4",
            "algo.generation.engine=vllm",
            "algo.generation.vllm.kv_cache_gib=0.0625",
        ],
    }[stage]
    return [
        "experiment=grpo_agent_tiny",
        *algo,
        f"algo.policy_path={policy}",
        *EVERY_BATCH,
        "logger=csv",
        "algo.rollout_batch_size=8",
        "algo.generation.max_new_tokens=40",
        "algo.val_pass_k=0",
        "algo.max_turns=3",
        "data.prompt.n_train=16",
        "data.prompt.n_val=4",
        "validate_before_fit=false",
        "trainer.limit_val_batches=0",
        "trainer.max_steps=4",
        "trainer.max_epochs=-1",
        "optimized_metric=null",
    ]


@pytest.mark.parametrize("stage", ["grpo", "ppo_max"])
def test_multi_turn_rl_trains_logs_its_turns_and_resumes_exactly(stage, agent_policy_dir, tmp_path):
    full = tmp_path / "full"
    run(compose(overrides(stage, agent_policy_dir), full))
    with open(next(full.rglob("metrics.csv"))) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("agent/turns")]
    assert len(rows) == (2 if stage == "ppo_max" else 4)  # PPO-max: 2 minibatches, 2 steps per iteration
    turns = [float(r["agent/turns"]) for r in rows]
    calls = [float(r["agent/tool_calls"]) for r in rows]
    assert max(turns) > 1.0 and max(calls) > 0  # the policy called the calculator and read its replies
    assert all(0 < float(r["agent/env_token_frac"]) < 1 for r in rows if float(r["agent/tool_calls"]) > 0)
    final = load(full / "checkpoints" / "last.ckpt")
    ckpts = sorted((full / "checkpoints").glob("b*.ckpt"))
    resumed = tmp_path / "resumed"
    run(compose([*overrides(stage, agent_policy_dir), f"ckpt_path={ckpts[0]}"], resumed))
    assert_same_end(
        load(resumed / "checkpoints" / "last.ckpt"), final, f"{stage} with tools resumed at {ckpts[0].name}"
    )
