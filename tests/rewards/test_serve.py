"""The reward server (``python -m lit_rlhf.serve``) started by the test on 127.0.0.1 with a tiny
saved reward model: its scores are the in-process reward model's on the same rows, concurrent
requests are batched, OpenRLHF's query-only requests work, the order holds across endpoints, and
bad requests, missing tokens and oversized requests get their HTTP status."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from lit_rlhf.rewards import RemoteReward
from lit_rlhf.utils import aio

TOKEN = "serve-test-token-9f2c"
pytestmark = pytest.mark.xdist_group("reward_server")


@pytest.fixture(scope="module")
def server(saved_models):
    """(url, rm dir, output lines) of one server process for the module."""
    _, rm = saved_models
    cmd = [sys.executable, "-m", "lit_rlhf.serve", "--model", rm, "--port", "0", "--template", "plain"]
    cmd += ["--max-batch", "16", "--max-wait-ms", "100", "--max-request-rows", "64", "--token-env", "RM_TOKEN"]
    env = {**os.environ, "RM_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "/get_reward" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120):
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(lines))
    url = next(line for line in lines if "/get_reward" in line).split(" on ")[-1].strip()
    yield url, rm, lines
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def in_process(server):
    """The same reward model scored in this process, as the RL stage's ModelScorer does."""
    import argparse

    from lit_rlhf.serve import load_scorer

    _, rm, _ = server
    return load_scorer(argparse.Namespace(model=rm, dtype="float32", device="cpu", template="plain", max_length=1024))


@pytest.fixture(scope="module")
def rows(tokenizer):
    words = [w for w in tokenizer.get_vocab() if w.isalpha()][:40]
    prompts = [" ".join(words[i : i + 3]) for i in range(12)]
    responses = [" ".join(words[i + 5 : i + 5 + (i % 4) + 1]) for i in range(12)]
    return prompts, responses


async def post(url, body, token=TOKEN):
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body), headers=headers) as r:
        return r.status, await r.json()


async def get(url):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def test_server_scores_equal_the_in_process_reward_model_in_order_across_endpoints(
    server, in_process, rows, monkeypatch
):
    url, _, _ = server
    prompts, responses = rows
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    second = url.replace("127.0.0.1", "localhost")  # a second endpoint name for the same server
    reward = RemoteReward([url, second], batch_size=3, token_env="RM_TOKEN", timeout_s=60)
    remote = aio.run(reward(prompts, responses, [True] * 12))
    local = in_process.score_texts(prompts, responses).tolist()
    assert torch.allclose(torch.tensor(remote), torch.tensor(local), atol=1e-5)
    assert len(set(round(v, 4) for v in local)) > 6  # distinct scores: an order mix-up would show
    assert reward.last_errors == 0


def test_concurrent_requests_are_batched(server, in_process, rows):
    url, _, _ = server
    prompts, responses = rows
    before = aio.run(get(url.replace("/get_reward", "/health")))

    async def burst():
        bodies = [{"prompts": prompts[i : i + 2], "responses": responses[i : i + 2]} for i in range(0, 12, 2)]
        return await asyncio.gather(*(post(url, b) for b in bodies))

    answers = aio.run(burst())
    health = aio.run(get(url.replace("/get_reward", "/health")))
    assert all(status == 200 for status, _ in answers)
    scores = [v for _, body in answers for v in body["rewards"]]
    assert torch.allclose(torch.tensor(scores), in_process.score_texts(prompts, responses), atol=1e-5)
    batches, served = health["batches"] - before["batches"], health["rows"] - before["rows"]
    assert served == 12 and batches < 6  # six requests of two rows, fewer forwards
    assert health["max_batch_rows"] > 2 and health["status"] == "ok"


def test_openrlhf_query_only_requests_score_the_text_as_it_is(server, in_process, rows):
    from lit_rlhf.data.chat import get_template

    url, _, _ = server
    prompts, responses = rows
    query = [p + " " + r for p, r in zip(prompts[:4], responses[:4])]
    status, body = aio.run(post(url, {"query": query, "prompts": prompts[:4], "labels": [None] * 4}))
    assert status == 200 and set(body) >= {"rewards", "scores"}
    expected = in_process.score_texts(query, [""] * 4, template=get_template("plain"))
    assert torch.allclose(torch.tensor(body["rewards"]), expected, atol=1e-5)


def test_bad_requests_get_their_status_and_the_token_is_never_printed(server, rows):
    url, _, lines = server
    prompts, responses = rows
    assert aio.run(post(url, {"query": ["x"]}, token=None))[0] == 401
    assert aio.run(post(url, {"query": ["x"]}, token="wrong"))[0] == 401
    status, body = aio.run(post(url, {"prompts": ["a"], "responses": ["b", "c"]}))
    assert status == 400 and "as long as 'responses'" in body["error"]
    status, body = aio.run(post(url, {"query": "not a list"}))
    assert status == 400 and "'query' must be a list" in body["error"]
    status, body = aio.run(post(url, {"query": ["x"] * 65}))
    assert status == 413 and "at most 64" in body["error"]
    assert aio.run(post(url, {"prompts": prompts[:1], "responses": responses[:1]}))[0] == 200  # still serving
    assert TOKEN not in "".join(lines)
