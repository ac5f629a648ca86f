"""GRPO runs (the real config, lit_rlhf.launch.runner.run) scored by a remote reward on 127.0.0.1:
a run survives an endpoint that fails some requests (those rows left out and counted, never a
stop for non-finite scores), stops cleanly after a checkpoint when every endpoint stays down, and
``ckpt_path=last`` then ends exactly where the uninterrupted run ends; the bearer token is in no
file of the run."""

from __future__ import annotations

import csv
import threading

import pytest

from lit_rlhf.launch.runner import run
from lit_rlhf.rewards import RewardServiceDown
from tests.conftest import compose
from tests.helpers.reward_servers import FaultServer, length_score
from tests.test_resume import EVERY_BATCH, TINY, assert_same_end, load

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("remote_run")]
TOKEN = "run-token-77aa51"


def overrides(saved_models, url: str, **reward) -> list[str]:
    settings = {"timeout_s": 5, "retries": 0, "backoff_s": 0.01, "max_backoff_s": 0.05, "give_up_after_s": 0.5}
    settings.update(reward)
    spec = ",".join([f"urls:'{url}'", "token_env:RM_TOKEN", *(f"{k}:{v}" for k, v in settings.items())])
    return [
        "experiment=grpo_synthetic_tiny",
        *TINY,
        *EVERY_BATCH,
        f"algo.policy_path={saved_models[0]}",
        "algo.reward_path=null",
        f"algo.reward_fn={{_target_:lit_rlhf.rewards.RemoteReward,{spec}}}",
        "algo.rollout_batch_size=8",  # 2 prompts x G = 4
        "algo.generation.max_new_tokens=6",
        "algo.max_bad_iterations=1",  # an unexcused NaN would stop the run at once
        "data.prompt.n_train=8",
        "data.prompt.n_val=4",
        "validate_before_fit=false",
        "trainer.limit_val_batches=0",
        "trainer.max_steps=4",
        "trainer.max_epochs=-1",
        "optimized_metric=null",
    ]


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    s = FaultServer()
    yield s
    s.close()


def test_failed_requests_are_left_out_and_counted_and_the_run_goes_on(server, saved_models, tmp_path):
    # two chunks of 4 rows (one group each) per iteration; every 4th request from the second fails
    good = server.behaviour
    server.behaviour = lambda p, n: (500, b"flaky", 0.0) if n % 4 == 1 else good(p, n)
    cfg = compose([*overrides(saved_models, server.url, batch_size=4), "logger=csv"], tmp_path)
    run(cfg)
    assert len(server.requests) == 8 and server.headers[0]["Authorization"] == f"Bearer {TOKEN}"
    with open(next(tmp_path.rglob("metrics.csv"))) as fh:
        rows = list(csv.DictReader(fh))
    errors = [float(r["reward/RemoteReward_errors"]) for r in rows if r.get("reward/RemoteReward_errors")]
    assert errors == [4.0, 0.0, 4.0, 0.0]  # iterations 1 and 3 lost their second group
    nonfinite = [float(r["health/nonfinite_scores"]) for r in rows if r.get("health/nonfinite_scores")]
    assert nonfinite == [0.0] * 4  # excused: the server's failure, not the policy's
    for path in tmp_path.rglob("*"):  # the token never reaches a file of the run
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_every_endpoint_down_stops_after_a_checkpoint_and_last_resumes_exactly(server, saved_models, tmp_path):
    base = overrides(saved_models, server.url, retries=1)  # the retry after the 503 finds nothing listening
    run(compose(base, tmp_path / "full"))
    final = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    assert len(server.requests) == 4

    def dies_at_third(payload, n):
        if n == 6:  # the 3rd iteration of the second run
            threading.Thread(target=server.stop).start()
            return 503, b"shutting down", 0.0
        return 200, {"rewards": length_score(payload)}, 0.0

    server.behaviour = dies_at_third
    out = tmp_path / "interrupted"
    with pytest.raises(RewardServiceDown) as err:
        run(compose(base, out))
    message = str(err.value)
    assert "every reward endpoint has been unreachable" in message and server.url in message
    assert "ckpt_path=last" in message and str(out / "checkpoints" / "last.ckpt") in message
    assert load(out / "checkpoints" / "last.ckpt")["global_step"] == 2  # the third iteration is redone

    server.behaviour = lambda p, n: (200, {"rewards": length_score(p)}, 0.0)
    server.start()
    run(compose([*base, "ckpt_path=last"], out))
    assert_same_end(load(out / "checkpoints" / "last.ckpt"), final, "GRPO resumed after a reward outage")
    assert [len(r["query"]) for r in server.requests[7:]] == [8, 8]  # iterations 3 and 4, once each


def test_the_memory_plan_lists_a_remote_reward_with_no_memory(tmp_path):
    from lit_rlhf.launch.runner import memory_plan

    url = "http://user:pw@rm-host:5000/get_reward"
    cfg = compose(
        [
            "algo=grpo",
            "model=llama7b",
            "algo.reward_path=null",
            f"algo.reward_fns=[{{_target_:lit_rlhf.rewards.RemoteReward,urls:'{url}',name:rm}},"
            "{_target_:lit_rlhf.rewards.format_reward,name:format}]",
        ],
        tmp_path,
    )
    plan = memory_plan(cfg)
    rows = {r.name: r for r in plan.rows}
    assert list(rows) == ["actor", "reference", "rm"]  # a local reward function holds no model
    assert rows["rm"].role == "remote: http://rm-host:5000/get_reward" and rows["rm"].total == 0
    assert "| rm | remote: http://rm-host:5000/get_reward |" in plan.render() and "pw" not in plan.render()
