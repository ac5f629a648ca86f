"""The remote reward client against small servers on 127.0.0.1 (tests/helpers/reward_servers.py):
order across endpoints, and each fault of the policy in lit_rlhf/rewards/http.py — HTTP 500s, slow
replies past the timeout, refused connections, an endpoint that dies and comes back, replies out of
order, malformed bodies, a 4xx, every endpoint down — plus the rate limits on a mocked clock and
the bearer token kept out of every message. Every loop here is bounded by small timeouts."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from lit_rlhf.rewards import PerResponse, RemoteReward, RemoteRewardError
from lit_rlhf.rewards.http import TokenBucket, shown_url
from lit_rlhf.utils import aio
from tests.helpers.reward_servers import FaultServer, free_port

FAST = dict(timeout_s=2.0, retries=2, backoff_s=0.01, max_backoff_s=0.05, give_up_after_s=5.0)
RESPONSES = [f"response {'x' * i}" for i in range(10)]
PROMPTS = [f"prompt {i}: " for i in range(10)]
EXPECTED = [float(len(r)) for r in RESPONSES]


def score(reward, responses=RESPONSES, prompts=PROMPTS, **columns):
    return aio.run(reward(prompts[: len(responses)], responses, [True] * len(responses), **columns))


@pytest.fixture
def servers():
    made: list[FaultServer] = []

    def make(behaviour=None) -> FaultServer:
        made.append(FaultServer(behaviour))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_chunks_spread_over_endpoints_and_come_back_in_order(servers):
    a, b, c = servers(), servers(), servers()
    reward = RemoteReward([a.url, b.url, c.url], batch_size=2, **FAST)
    answers = ["7"] * 10
    assert score(reward, answer=answers) == EXPECTED
    assert (len(a.requests), len(b.requests), len(c.requests)) == (2, 2, 1)  # chunks 0,3 / 1,4 / 2
    first = a.requests[0]
    assert first["query"] == [PROMPTS[0] + RESPONSES[0], PROMPTS[1] + RESPONSES[1]]  # OpenRLHF's fields
    assert first["prompts"] == PROMPTS[:2] and first["labels"] == ["7", "7"]
    assert reward.last_errors == 0 and reward.last_retries == 0 and reward.outage is None


def test_default_chunks_one_per_endpoint_and_comma_separated_urls(servers):
    a, b = servers(), servers()
    reward = RemoteReward(f"{a.url},{b.url}", **FAST)
    assert score(reward) == EXPECTED
    assert [len(r["query"]) for r in a.requests + b.requests] == [5, 5]


def test_replies_out_of_order_keep_the_batch_order(servers):
    # the first chunk is answered last: its reply arrives after every other one
    server = servers(
        lambda p, n: (200, {"rewards": [len(r) for r in p["responses"]]}, 0.3 if "x" not in p["responses"][0] else 0.0)
    )
    reward = RemoteReward(server.url, batch_size=1, **FAST)
    assert score(reward) == EXPECTED
    assert len(server.requests) == 10


def test_http_500_is_retried_on_the_next_endpoint(servers):
    broken = servers(lambda p, n: (500, {"error": "boom"}, 0.0))
    good = servers()
    reward = RemoteReward([broken.url, good.url], **FAST)
    assert score(reward) == EXPECTED
    assert reward.last_retries == 1 and reward.last_errors == 0  # chunk 0 moved to the good endpoint
    assert len(broken.requests) == 1 and len(good.requests) == 2


def test_rows_a_failing_endpoint_cannot_score_are_nan_and_counted(servers):
    broken = servers(lambda p, n: (503, b"overloaded", 0.0))
    reward = RemoteReward(broken.url, batch_size=4, **FAST)
    out = score(reward)
    assert all(math.isnan(v) for v in out)
    assert reward.last_errors == reward.last_unscored == 10
    assert len(broken.requests) == 3 * 3  # 3 chunks x (1 + 2 retries)
    assert "HTTP 503: overloaded" in reward.last_error_example and broken.url in reward.last_error_example


def test_transient_500s_then_success(servers):
    flaky = servers(
        lambda p, n: (500, b"", 0.0) if n < 2 else (200, {"rewards": [len(r) for r in p["responses"]]}, 0.0)
    )
    reward = RemoteReward(flaky.url, **FAST)
    assert score(reward) == EXPECTED
    assert reward.last_retries == 2 and reward.last_errors == 0


def test_slow_reply_past_the_timeout_is_retried_then_counted(servers):
    slow = servers(lambda p, n: (200, {"rewards": [0.0] * len(p["responses"])}, 1.0))
    reward = RemoteReward(slow.url, **{**FAST, "timeout_s": 0.2, "retries": 1})
    out = score(reward, RESPONSES[:3])
    assert all(math.isnan(v) for v in out) and reward.last_errors == 3
    assert "no answer within timeout_s=0.2" in reward.last_error_example
    assert len(slow.requests) == 2


def test_malformed_json_and_wrong_length_are_retried(servers):
    replies = [b"{not json", {"rewards": [1.0]}, {"scores": [1.0, 2.0]}, {"rewards": ["a", "b"]}]
    bad = servers(
        lambda p, n: (
            (200, replies[n], 0.0) if n < len(replies) else (200, {"rewards": [len(r) for r in p["responses"]]}, 0.0)
        )
    )
    reward = RemoteReward(bad.url, **{**FAST, "retries": 4})
    assert score(reward, RESPONSES[:2]) == EXPECTED[:2]
    assert reward.last_retries == 4


def test_a_bare_list_answer_is_accepted(servers):
    server = servers(lambda p, n: (200, [len(r) for r in p["responses"]], 0.0))
    assert score(RemoteReward(server.url, **FAST)) == EXPECTED


def test_refused_connection_moves_on_without_a_retry(servers):
    good = servers()
    reward = RemoteReward([f"http://127.0.0.1:{free_port()}", good.url], **FAST)
    assert score(reward) == EXPECTED
    assert reward.last_retries == 0 and len(good.requests) == 2
    assert reward.pool.endpoints[0].down_since is not None and reward.pool.endpoints[1].down_since is None


def test_an_endpoint_that_dies_mid_run_and_comes_back(servers):
    a, b = servers(), servers()
    reward = RemoteReward([a.url, b.url], **FAST)
    assert score(reward) == EXPECTED
    a.stop()  # dies between two iterations
    assert score(reward) == EXPECTED  # its chunk went to b
    assert len(a.requests) == 1 and len(b.requests) == 3
    a.start()
    time.sleep(0.06)  # past its probe backoff (max_backoff_s=0.05)
    assert score(reward) == EXPECTED
    assert len(a.requests) == 2 and reward.pool.endpoints[0].down_since is None  # up again


def test_waits_while_every_endpoint_is_down_and_goes_on_when_one_returns(servers):
    a = servers()
    a.stop()
    reward = RemoteReward(a.url, **FAST)
    threading.Timer(0.3, a.start).start()
    assert score(reward, RESPONSES[:2]) == EXPECTED[:2]  # no retry used up, nothing lost
    assert reward.outage is None and reward.last_errors == 0


def test_every_endpoint_down_past_the_limit_is_an_outage_not_an_exception():
    url = f"http://user:pw@127.0.0.1:{free_port()}/get_reward?key=s3cret"
    reward = RemoteReward(url, **{**FAST, "give_up_after_s": 0.2})
    out = score(reward, RESPONSES[:3])
    assert all(math.isnan(v) for v in out) and reward.last_errors == 3
    assert "every reward endpoint has been unreachable" in reward.outage
    assert shown_url(url) in reward.outage and "pw" not in reward.outage and "s3cret" not in reward.outage


def test_a_client_error_stops_with_the_endpoint_and_status(servers):
    server = servers(lambda p, n: (404, b"no such route", 0.0))
    with pytest.raises(RemoteRewardError, match=r"127\.0\.0\.1:\d+/get_reward answered HTTP 404: no such route"):
        score(RemoteReward(server.url, **FAST))
    server = servers(lambda p, n: (401, b"", 0.0))
    with pytest.raises(RemoteRewardError, match=r"HTTP 401 \(check token_env\)"):
        score(RemoteReward(server.url, **FAST))


def test_bearer_token_is_sent_and_never_shown(servers, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-123-secret")
    server = servers(lambda p, n: (500, b"", 0.0))
    reward = RemoteReward(server.url, token_env="RM_TOKEN", **{**FAST, "retries": 0})
    score(reward, RESPONSES[:1])
    assert server.headers[0]["Authorization"] == "Bearer tok-123-secret"
    assert "tok-123" not in repr(reward) + str(reward.last_error_example)
    with pytest.raises(RemoteRewardError, match="environment variable NOT_SET_ANYWHERE"):
        RemoteReward(server.url, token_env="NOT_SET_ANYWHERE")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": "ftp://x"}, "is not an http"),
        ({"urls": ""}, "no endpoint"),
        ({"urls": "http://a", "retries": -1}, "retries must be"),
        ({"urls": "http://a", "timeout_s": 0}, "timeout_s must be"),
        ({"urls": "http://a", "batch_size": 0}, "batch_size must be"),
        ({"urls": "http://a", "max_rpm": -5}, "rate limit must be > 0"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(RemoteRewardError, match=message):
        RemoteReward(**kwargs)


class FakeClock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def test_token_bucket_holds_the_rate_in_every_window():
    clock = FakeClock()
    bucket = TokenBucket(120, clock, clock.sleep)  # 2 a second

    async def take(n):
        lock, times = asyncio.Lock(), []
        for _ in range(n):
            await bucket.acquire(1, lock)
            times.append(clock.now)
        return times

    times = aio.run(take(300))
    for start in times:  # any 60 s window holds at most 120 + the bucket (2)
        assert sum(1 for t in times if start <= t < start + 60) <= 122
    assert times[-1] == pytest.approx((300 - 2) / 2)  # and no slower than the rate
    big = aio.run(_acquire(bucket, 10))  # larger than the bucket: waits for a full one, leaves a debt
    assert big == pytest.approx(times[-1] + 1.0)
    assert bucket.level == pytest.approx(2 - 10)


async def _acquire(bucket, units):
    await bucket.acquire(units, asyncio.Lock())
    return bucket.clock()


def test_requests_and_tokens_per_minute_through_the_reward(servers):
    server = servers()
    clock = FakeClock()
    reward = RemoteReward(server.url, batch_size=1, max_rpm=60, clock=clock, sleep=clock.sleep, **FAST)
    assert score(reward) == EXPECTED
    assert clock.now == pytest.approx(9.0)  # 10 requests at 1 a second, the first at once
    clock2 = FakeClock()
    texts = ["y" * 400] * 4  # "p" + 400 characters: 101 tokens a request
    reward = RemoteReward(server.url, batch_size=1, max_tpm=6060, clock=clock2, sleep=clock2.sleep, **FAST)
    assert score(reward, texts, prompts=["p"] * 4) == [400.0] * 4
    assert clock2.now == pytest.approx(3.0)  # 101 tokens a second: one request a second


def test_per_response_async_reward_runs_concurrently_and_counts_failures():
    live = {"now": 0, "max": 0}

    async def judge_one(prompt, response, answer=None):
        live["now"] += 1
        live["max"] = max(live["max"], live["now"])
        await asyncio.sleep(0.02)
        live["now"] -= 1
        if response == "bad":
            raise ValueError("cannot judge")
        return float(response == answer)

    reward = PerResponse(judge_one, max_concurrent=3)
    out = aio.run(reward(["q"] * 6, ["a", "b", "bad", "a", "a", "c"], None, answer=["a"] * 6, other=[0] * 6))
    assert out[:2] == [1.0, 0.0] and math.isnan(out[2]) and out[3:] == [1.0, 1.0, 0.0]
    assert live["max"] == 3  # awaited together, bounded by max_concurrent
    assert reward.last_errors == reward.last_unscored == 1 and "cannot judge" in reward.last_error_example
    with pytest.raises(Exception, match="failed on every response"):
        aio.run(reward(["q"], ["bad"], None, answer=["a"]))
    with pytest.raises(Exception, match="is not an `async def`"):
        PerResponse(len)
