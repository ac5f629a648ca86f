"""The multi-turn loop's bookkeeping (lit_rlhf/rollout/agent.py) on hand-built turns: a scripted engine
returns given token ids for each trajectory's turn, so every id, mask and count is known in advance.
The engines themselves run in tests/rollout/test_agent_engines.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lit_rlhf.rollout.agent import AgentLoop, AgentSettings
from lit_rlhf.rollout.environment import EnvironmentSpecError, ToolCall, parse_tool_calls, tool_schemas
from lit_rlhf.rollout.generate import GenerationConfig
from tests.data.test_chat import make_chat_tokenizer

SUFFIX = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"  # ChatML's tool turn, written out by hand


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_chat_tokenizer("chatml", tmp_path_factory.mktemp("agent_bpe"))


class Calc:
    """Tools of the tests; ``calls`` records what ran (shared by the class: one list per test)."""

    calls: list = []

    def reset(self, answer=None, offset: int = 0) -> str | None:
        self.offset = offset
        return f"offset {offset}" if offset else None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        Calc.calls.append(("add", a, b))
        return a + b + self.offset

    def divide(self, a: int, b: int) -> float:
        """Divide.

        Args:
            a: the dividend
            b: the divisor
        """
        Calc.calls.append(("divide", a, b))
        return a / b

    def slow(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    def long(self, n: int) -> str:
        """A long reply.

        Args:
            n: words
        """
        return " ".join(f"w{i}" for i in range(n))

    def reward(self) -> float:
        return 0.5


class Script:
    """An engine that answers turn k of row i with ``turns[i][k]`` (text or ids), recording each call's
    contexts; a turn's text ends with <|im_end|> unless it is to be cut by the budget."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, []

    def ids(self, value):
        return value if isinstance(value, list) else self.tok(value, add_special_tokens=False)["input_ids"]

    def __call__(self, ids, mask, gen, budgets=None):
        contexts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        assert len(budgets) == len(contexts) and max(budgets) == gen.max_new_tokens
        self.calls.append((contexts, gen.max_new_tokens, budgets))
        rows = []
        for ctx in contexts:
            i = self.row_of(ctx)
            k = self.tok.decode(ctx).count("<|im_start|>assistant") - 1
            rows.append(self.ids(self.turns[i][min(k, len(self.turns[i]) - 1)])[: gen.max_new_tokens])
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.tok.pad_token_id)
        m = torch.zeros(len(rows), width, dtype=torch.long)
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        for j, r in enumerate(rows):
            out[j, : len(r)], m[j, : len(r)] = torch.tensor(r), 1
        ended = torch.tensor([bool(r) and r[-1] == end for r in rows])
        logps = -0.1 * m.float()
        return out, m, ended, logps

    def row_of(self, ctx):
        text = self.tok.decode(ctx)
        return int(text.split("row ")[1].split("<|im_end|>")[0].split()[0])


def run(tok, turns, env="tests.rollout.test_agent.Calc", columns=None, budget=2000, **settings):
    Calc.calls = []
    loop = AgentLoop(AgentSettings(environment={"_target_": env}, **settings))
    n = len(turns)
    batch = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompts": [f"row {i}" for i in range(n)]}
    if columns:
        batch["columns"] = columns
    script = Script(tok, turns)
    out = loop.run(script, batch, tok, GenerationConfig(max_new_tokens=budget), tok.pad_token_id)
    stats = loop.take_stats()
    loop.close()
    return out, stats, script


def call(name, **args):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call><|im_end|>"


def test_the_trained_ids_are_the_sampled_ids_and_the_templates_reply_byte_for_byte(tok):
    # "Hello" as single-letter tokens: not what encoding the text gives, so a decode/encode round
    # trip between turns would change the ids (BPE is not a bijection)
    letters = [tok.convert_tokens_to_ids(c) for c in "Hello"]
    assert tok("Hello", add_special_tokens=False)["input_ids"] != letters
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok(call("add", a=2, b=3), add_special_tokens=False)["input_ids"]
    out, stats, script = run(tok, [[first, letters + [end]]])
    reply = tok(SUFFIX.format(5), add_special_tokens=False)["input_ids"]
    assert out.response_ids[0].tolist() == first + reply + letters + [end]
    assert out.response_mask[0].tolist() == [1] * len(first) + [0] * len(reply) + [1] * 6
    assert out.attention_mask[0].tolist() == [1] * (len(first) + len(reply) + 6)
    # the second turn continued from exactly the held ids
    assert script.calls[1][0][0] == out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() + first + reply
    assert out.sampler_logprobs[0].tolist() == pytest.approx([-0.1] * len(first) + [0.0] * len(reply) + [-0.1] * 6)
    assert bool(out.ended[0]) and out.env_reward == [0.5] and out.tool_calls == [1] and out.turns == [2]
    assert out.texts[0].endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\nHello")
    assert stats["retokenized"] == 1 and stats["template_rewrites"] == 0  # held ids kept, the divergence counted
    assert stats["env_token_frac"] == pytest.approx(len(reply) / (len(first) + len(reply) + 6))


def test_the_prompt_is_rendered_with_the_tools_and_the_first_observation(tok):
    out, _, _ = run(tok, [["done<|im_end|>"]], columns={"offset": [3]})
    prompt = tok.decode(out.prompt_ids[0][out.prompt_mask[0].bool()])
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in prompt and '"name": "slow"' in prompt
    assert prompt.endswith("<|im_start|>user\nrow 0\n\noffset 3<|im_end|>\n<|im_start|>assistant\n")


def test_a_rows_tools_column_restricts_the_tools(tok):
    turns = [[call("divide", a=1, b=1), "x<|im_end|>"]]
    out, stats, _ = run(tok, turns, columns={"tools": [["add"]]})
    prompt = tok.decode(out.prompt_ids[0][out.prompt_mask[0].bool()])
    assert '"name": "add"' in prompt and '"name": "divide"' not in prompt
    assert Calc.calls == [] and stats["malformed_calls"] == 1  # not offered to this row: not run
    assert "unknown tool 'divide' (tools: add)" in out.texts[0]
    with pytest.raises(EnvironmentSpecError, match="prompt row 0: tool 'nope' is not one of the environment's"):
        run(tok, turns, columns={"tools": [["nope"]]})


def test_failures_become_the_replies_and_are_counted(tok):
    turns = [
        [call("divide", a=1, b=0), "a<|im_end|>"],  # the tool raises
        [call("slow", seconds=2.0), "b<|im_end|>"],  # past the timeout
        ["<tool_call>{not json}</tool_call><|im_end|>", "c<|im_end|>"],  # malformed
        [call("add", a=1), "d<|im_end|>"],  # a missing argument: the call raises TypeError
        ["<tool_call>{" + '"name": "add"<|im_end|>', "e<|im_end|>"],  # never closed
    ]
    started = time.monotonic()
    out, stats, _ = run(tok, turns, tool_timeout_s=0.3)
    assert time.monotonic() - started < 1.8  # the slow call did not hold the batch
    assert "Error: ZeroDivisionError: division by zero" in out.texts[0]
    assert "Error: the tool call timed out after 0.3 s" in out.texts[1]
    assert "Error: malformed tool call: not JSON" in out.texts[2]
    assert "Error: TypeError" in out.texts[3] and "missing 1 required positional argument: 'b'" in out.texts[3]
    assert "Error: malformed tool call: <tool_call> is never closed" in out.texts[4]
    assert (stats["tool_errors"], stats["tool_timeouts"], stats["malformed_calls"]) == (2, 1, 2)
    assert stats["tool_calls"] == 1.0 and stats["turns"] == 2.0  # per trajectory: every row went on after its reply
    assert out.ended.all()


def test_max_turns_ends_a_trajectory_without_running_its_last_calls(tok):
    out, stats, script = run(tok, [[call("add", a=1, b=1)]], max_turns=3)
    assert out.turns == [3] and len(Calc.calls) == 2 and len(script.calls) == 3
    assert stats["max_turns"] == 1.0 and bool(out.ended[0])


def test_the_budget_cuts_the_last_turn_and_it_stays_truncated(tok):
    first = tok(call("add", a=2, b=3), add_special_tokens=False)["input_ids"]
    reply = tok(SUFFIX.format(5), add_special_tokens=False)["input_ids"]
    budget = len(first) + len(reply) + 3
    out, stats, script = run(tok, [[first, "It is five, yes it is.<|im_end|>"]], budget=budget)
    assert int(out.response_mask[0].sum()) == len(first) + 3 and not bool(out.ended[0])
    assert script.calls[1][1:] == (3, [3])  # the second turn may take what is left of the budget
    assert stats["truncated"] == 1.0
    # a reply that does not fit leaves no room for the policy: the trajectory ends there, truncated
    out, stats, _ = run(tok, [[first, "x<|im_end|>"]], budget=len(first) + len(reply))
    assert out.response_ids.shape[1] == len(first) and not bool(out.ended[0]) and stats["truncated"] == 1.0


@pytest.mark.parametrize("side", ["keep_start", "keep_end"])
def test_a_long_reply_is_cut_on_the_named_side(tok, side):
    out, stats, _ = run(
        tok, [[call("long", n=40), "x<|im_end|>"]], max_tool_response_tokens=6, tool_response_truncation=side
    )
    full = " ".join(f"w{i}" for i in range(40))
    ids = tok(full, add_special_tokens=False)["input_ids"]
    kept = tok.decode(ids[:6] if side == "keep_start" else ids[-6:])
    assert f"<|im_start|>tool\n{kept}<|im_end|>" in out.texts[0]
    assert stats["tool_response_truncated"] == 1.0


def test_a_partial_batch_of_uneven_trajectories(tok):
    turns = [
        ["a<|im_end|>"],
        [call("add", a=1, b=2), call("add", a=3, b=4), "b<|im_end|>"],
        [call("add", a=100, b=2000)],
    ]
    out, stats, script = run(tok, turns, max_turns=4)
    assert out.turns == [1, 3, 4] and out.tool_calls == [0, 2, 3]
    assert [len(c[0]) for c in script.calls] == [3, 2, 2, 1]  # only the active trajectories are continued
    assert script.calls[1][2][0] > script.calls[1][2][1]  # each its own budget: row 2 has used more of it
    lengths = out.attention_mask.sum(1).tolist()
    assert out.response_ids.shape == (3, max(lengths)) and out.response_mask.sum(1).tolist() < lengths


class Rewriter(Calc):
    pass


def test_a_template_that_rewrites_earlier_turns_is_counted_and_the_held_ids_win(tok):
    # Qwen3's way: earlier assistant turns are rendered without their <think> block
    original = tok.chat_template
    tok.chat_template = original.replace(
        "{{ m['content'] }}",
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}",
    )
    try:
        first = "<think>hmm</think>" + call("add", a=1, b=1)
        out, stats, script = run(tok, [[first, "x<|im_end|>"]])
    finally:
        tok.chat_template = original
    held = tok(first, add_special_tokens=False)["input_ids"]
    assert out.response_ids[0, : len(held)].tolist() == held  # the thinking the policy sampled is trained on
    assert stats["template_rewrites"] == 1.0 and stats["retokenized"] == 1.0


class Game:
    """A text game: guess the secret; every wrong guess costs 0.1."""

    def reset(self, secret: int) -> None:
        self.secret = secret

    def step(self, text: str):
        guess = int(text.split()[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), -0.1, False


def test_a_text_game_answers_every_turn_and_its_rewards_add_up(tok):
    turns = [["3<|im_end|>", "9<|im_end|>", "7<|im_end|>"], ["7<|im_end|>"], ["1<|im_end|>"]]
    out, stats, _ = run(tok, turns, env="tests.rollout.test_agent.Game", columns={"secret": [7, 7, 7]}, max_turns=2)
    assert out.turns == [2, 1, 2] and out.tool_calls == [0, 0, 0]
    assert out.env_reward == pytest.approx([-0.2, 1.0, -0.2])  # the last turn's guess is judged too
    assert (
        out.texts[0] == "3<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n9"
    )  # no reply after the last turn
    assert stats["max_turns"] == pytest.approx(2 / 3)


class BrokenGame(Game):
    def step(self, text: str):
        raise RuntimeError("boom")


def test_a_game_whose_step_fails_leaves_its_row_out(tok):
    out, stats, _ = run(tok, [["3<|im_end|>"]], env="tests.rollout.test_agent.BrokenGame", columns={"secret": [1]})
    assert torch.isnan(torch.tensor(out.env_reward)).all() and stats["env_errors"] == 1.0


def test_parse_tool_calls():
    calls = parse_tool_calls('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b')
    assert calls == [ToolCall("f", {"x": 1})]
    calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>[1]</tool_call>'
    )
    assert calls[0] == ToolCall("f", {"x": 2}) and calls[1].name is None and "expected" in calls[1].error
    assert parse_tool_calls("no call here") == []


def test_a_tool_without_a_described_argument_is_refused_with_its_name():
    class Bad:
        def f(self, x: int) -> int:
            """No args section."""
            return x

    with pytest.raises(EnvironmentSpecError, match=r"Bad.f: a tool needs type hints and a docstring"):
        tool_schemas(Bad())


def test_async_tools_are_awaited_in_their_workers(tok):
    seen = []

    class Async(Calc):
        async def fetch(self, key: str) -> str:
            """Fetch.

            Args:
                key: the key
            """
            seen.append(threading.current_thread().name)
            return key.upper()

    import tests.rollout.test_agent as me

    me.Async = Async
    out, _, _ = run(tok, [[call("fetch", key="abc"), "x<|im_end|>"]], env="tests.rollout.test_agent.Async")
    assert "<|im_start|>tool\nABC<|im_end|>" in out.texts[0] and seen[0].startswith("lit-rlhf-tool")


class BadReset(Calc):
    def reset(self, answer=None, offset: int = 0) -> str | None:
        raise KeyError("no such task")


def test_an_environment_that_cannot_start_stops_the_run_naming_it(tok):
    from lit_rlhf.rollout.agent import EnvironmentResetError

    with pytest.raises(EnvironmentResetError, match=r"algo.environment: BadReset.reset raised KeyError.*row 0"):
        run(tok, [["x<|im_end|>"]], env="tests.rollout.test_agent.BadReset")
    loop = AgentLoop(AgentSettings(environment={"_target_": "tests.rollout.test_agent.Calc", "nope": 1}))
    batch = {"prompt_ids": torch.zeros(1, 1, dtype=torch.long), "prompts": ["row 0"]}
    with pytest.raises(EnvironmentResetError, match=r"Calc.__init__ raised TypeError"):
        loop.run(Script(tok, [["x<|im_end|>"]]), batch, tok, GenerationConfig(max_new_tokens=50), tok.pad_token_id)
    loop.close()
