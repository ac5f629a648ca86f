"""Multi-turn rollouts: the policy and an environment take turns, token in, token out (docs/agents.md).

:class:`AgentLoop` runs inside the one rollout path (rollout/collect.py ``sample_responses``) when
``algo.environment`` is set, with either engine: it only asks the engine for the next turn of every
trajectory that is still going. Per turn:

1. every active trajectory of the batch (all G copies of all prompts) is continued in ONE batched
   call of the engine, from its whole context (prompt, earlier turns, the environment's replies),
   up to the template's end-of-turn token or what is left of the token budget
   (``algo.generation.max_new_tokens`` counts the policy's and the environment's tokens);
2. the turn's text is read for tool calls (tool environments; ``algo.tool_parser``) or handed to
   ``step`` (text games). The calls of all trajectories run concurrently in worker threads, each
   with ``algo.tool_timeout_s``; an exception, a timeout or a malformed call becomes the reply's
   text and is counted. A turn without a call, a game's ``done``, ``algo.max_turns`` or the budget
   ends the trajectory;
3. the replies are appended as the chat template renders them after an assistant turn (the suffix
   a rendering with the new messages adds: the tool turn and the next generation prompt), each
   tool reply cut to ``algo.max_tool_response_tokens`` on the side ``algo.tool_response_truncation``
   names.

**Token in, token out.** The sampled ids are kept as the engine returned them, never decoded and
encoded again; the policy's tokens have ``response_mask`` 1 and the environment's 0, and every
token is in ``response_attention_mask`` (context for every later forward: no loss, no KL, no
entropy, no length statistic at the environment's). When re-rendering the finished conversation
does not reproduce the held ids — a template that rewrites earlier turns (Qwen3 drops past
``<think>`` blocks), or a sampled token sequence that the tokenizer would split differently — the
held ids are trained on and the trajectory is counted (``agent/template_rewrites``,
``agent/retokenized``).

Under several processes every rank runs the same number of turns with the same token budget per
turn (sampling is collective: gathered weights, the decoding loop's step agreement): a rank whose
trajectories have all ended samples a placeholder row while others go on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor

from lit_rlhf.data.chat import as_messages, has_chat_template, template_facts
from lit_rlhf.rollout.environment import (
    EnvironmentSpecError,
    ToolCall,
    as_tool_call,
    is_text_environment,
    parse_tool_calls,
    reply_text,
    reset_environment,
    row_tools,
    tool_methods,
    tool_schemas,
)
from lit_rlhf.utils.distributed import all_reduce_max, all_reduce_sum
from lit_rlhf.utils.errors import UserError

Draw = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor | None]]
"""The engine, for one turn: (context ids (N, T) left-padded, mask, GenerationConfig, budgets=each row's
most new tokens) → (turn ids (N, R), mask, ended (N,), sampler log-probs or None): rollout/generate.py
``sample``'s contract (the hf loop runs every row to the widest budget: a row past its own is cut after)."""

STATS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "malformed_calls",
    "env_errors",
    "truncated",
    "max_turns",
    "tool_response_truncated",
    "template_rewrites",
    "retokenized",
    "policy_tokens",
    "env_tokens",
    "trajectories",
)


class EnvironmentResetError(UserError, RuntimeError):
    """The environment itself failed (its constructor or ``reset`` raised): a bug of the environment,
    not the policy's; the run stops with this message."""


@dataclass
class AgentSettings:
    """The multi-turn keys of an RL stage's config (``algo.*``, modules/configs.py ``RLConfig``)."""

    environment: Mapping[str, Any]
    max_turns: int = 8
    max_tool_response_tokens: int | None = 256
    tool_response_truncation: Literal["keep_start", "keep_end"] = "keep_start"
    tool_timeout_s: float = 30.0
    tool_workers: int = 32
    tool_parser: Mapping[str, Any] | None = None
    max_prompt_length: int | None = None


def agent_settings(algo: Any, max_prompt_length: int | None = None) -> AgentSettings | None:
    """The multi-turn settings of an RL stage's config (its ``algo.*`` keys: a typed config or a
    composed node), None when it has no ``environment``."""
    if algo.environment is None:
        return None
    return AgentSettings(
        environment=dict(algo.environment),
        max_turns=algo.max_turns,
        max_tool_response_tokens=algo.max_tool_response_tokens,
        tool_response_truncation=algo.tool_response_truncation,
        tool_timeout_s=algo.tool_timeout_s,
        tool_workers=algo.tool_workers,
        tool_parser=None if algo.tool_parser is None else dict(algo.tool_parser),
        max_prompt_length=max_prompt_length,
    )


def total_counts(rows: list[dict[str, int]]) -> dict[str, int]:
    """The counts of several trajectories (:attr:`AgentRollout.counts`) added up, as
    :meth:`AgentLoop.take_counts` returns them."""
    return {k: sum(c[k] for c in rows) for k in STATS}


def summarize_counts(s: dict[str, int]) -> dict[str, float]:
    """``agent/*`` of raw counts: per-trajectory means of turns, calls, truncations; the share of
    the environment's tokens; the other counts as they are."""
    n = max(s["trajectories"], 1)
    tokens = max(s["policy_tokens"] + s["env_tokens"], 1)
    out = {k: float(s[k]) for k in STATS if k not in ("trajectories", "policy_tokens", "env_tokens")}
    out.update(turns=s["turns"] / n, tool_calls=s["tool_calls"] / n)
    out.update(truncated=s["truncated"] / n, max_turns=s["max_turns"] / n, env_token_frac=s["env_tokens"] / tokens)
    return out


@dataclass
class Trajectory:
    """One trajectory while it runs: its conversation, its ids (the prompt's and every later
    token's), which of them the policy sampled, and its counts."""

    env: Any
    row: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = the environment's
    logps: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # message index after each assistant turn
    done: bool = False
    ended: bool = False  # the last policy turn ended with the end-of-turn token (False: the budget cut it)
    reward: float = 0.0  # a text game's step rewards, or the tool environment's reward()
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))


@dataclass
class AgentRollout:
    """The trajectories of a batch as tensors: the rollout path's ``sample`` result and the rest."""

    prompt_ids: Tensor  # (B, P) the prompts as rendered with the tools (left-padded)
    prompt_mask: Tensor
    response_ids: Tensor  # (B, R) every token after the prompt, right-padded
    response_mask: Tensor  # (B, R) 1 = a token the policy sampled
    attention_mask: Tensor  # (B, R) 1 = a real token (the policy's or the environment's)
    ended: Tensor  # (B,) the last policy turn ended (False: truncated by the budget)
    sampler_logprobs: Tensor | None  # (B, R) the engine's log-probs of the policy's tokens, 0 elsewhere
    texts: list[str]  # each trajectory after the prompt as text, special tokens (roles) shown
    env_reward: list[float]  # each environment's reward (NaN: its step or reward() failed)
    tool_calls: list[int]  # each trajectory's tool calls (a cost per call is a reward of them)
    turns: list[int]  # each trajectory's policy turns
    counts: list[dict[str, int]] = field(default_factory=list)  # each trajectory's counts (STATS)


class AgentLoop:
    """The multi-turn rollout of a run (one per RL module, closed with it: it owns the tool workers)."""

    def __init__(self, settings: AgentSettings):
        from hydra.utils import get_object

        self.settings = settings
        spec = dict(settings.environment)
        self.env_class = get_object(spec.pop("_target_"))
        self.env_kwargs = spec
        self.parser: Callable[[str], list[Any]] = parse_tool_calls
        if settings.tool_parser is not None:
            from hydra.utils import instantiate

            self.parser = instantiate(dict(settings.tool_parser))
        self.pool = ThreadPoolExecutor(settings.tool_workers, thread_name_prefix="lit-rlhf-tool")
        self.stats = dict.fromkeys(STATS, 0)

    def close(self) -> None:
        """Stop taking tool calls (a call still running past its timeout is left to finish)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def take_stats(self, other: dict[str, int] | None = None) -> dict[str, float]:
        """``agent/*`` statistics of the trajectories since the last call (docs/metrics.md), with
        those of ``other`` counts (another loop's :meth:`take_counts`: an asynchronous producer's)."""
        s = self.take_counts()
        for k, v in (other or {}).items():
            s[k] += v
        return summarize_counts(s)

    def take_counts(self) -> dict[str, int]:
        """The raw counts since the last call (reset)."""
        s, self.stats = self.stats, dict.fromkeys(STATS, 0)
        return s

    # ------------------------------------------------------------------ the loop
    def run(self, draw: Draw, batch: Mapping[str, Any], tokenizer: Any, gen: Any, pad_id: int) -> AgentRollout:
        """The trajectories of every row of ``batch`` (a group's rows are already repeated):
        ``prompts`` and ``columns`` (each row's dataset columns, handed to ``reset`` by name)."""
        device, with_logps = batch["prompt_ids"].device, False
        trajectories = [self.start(tokenizer, batch, i) for i in range(len(batch["prompts"]))]
        for turn in range(self.settings.max_turns):
            active = [t for t in trajectories if not t.done]
            if not self.any_rank(len(active), device):
                break
            budgets = [gen.max_new_tokens - len(t.response) for t in active]
            width = int(all_reduce_max(torch.tensor([max(budgets, default=1)], device=device))[0])
            # a placeholder (a prompt alone) keeps a rank whose trajectories have ended in the collective sampling
            contexts = [t.prompt + t.response for t in active] or [trajectories[0].prompt]
            ids, mask = _left_pad(contexts, pad_id, device)
            out_ids, out_mask, out_ended, out_logps = draw(
                ids, mask, replace(gen, max_new_tokens=width), budgets=budgets or [width]
            )
            with_logps = out_logps is not None
            for j, t in enumerate(active):
                n = int(out_mask[j].sum())
                logps = out_logps[j, :n].tolist() if out_logps is not None else [0.0] * n
                self.take_turn(t, out_ids[j, :n].tolist(), logps, bool(out_ended[j]), gen, tokenizer)
            self.reply(active, tokenizer, gen, last_turn=turn == self.settings.max_turns - 1)
        return self.finish(trajectories, tokenizer, pad_id, device, with_logps)

    def start(self, tokenizer: Any, batch: Mapping[str, Any], i: int) -> Trajectory:
        """Row ``i``'s environment (built, reset with the row's columns), tools and rendered prompt."""
        row = {k: v[i] for k, v in (batch.get("columns") or {}).items()}
        step = "__init__"
        try:
            env = self.env_class(**self.env_kwargs)
            step = "reset"
            obs = reset_environment(env, row)
        except UserError:
            raise
        except Exception as err:
            raise EnvironmentResetError(
                f"algo.environment: {self.env_class.__qualname__}.{step} raised {type(err).__name__}: {err} "
                f"(prompt row {i} of the batch)"
            ) from err
        messages = [dict(m) for m in as_messages(batch["prompts"][i])]
        if obs:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{obs}"
        tools = row_tools(tool_schemas(env), row.get("tools"), f"prompt row {i}")
        prompt = tokenizer(self.render(tokenizer, messages, tools, True), add_special_tokens=False)["input_ids"]
        limit = self.settings.max_prompt_length
        if limit and len(prompt) > limit:
            raise EnvironmentSpecError(
                f"prompt row {i} renders to {len(prompt)} tokens with its tools and first observation, over "
                f"data.prompt.max_prompt_length={limit} (a cut prompt would lose the tools or the question)"
            )
        return Trajectory(env=env, row=row, messages=messages, tools=tools, prompt=prompt)

    def take_turn(self, t: Trajectory, ids: list[int], logps: list[float], ended: bool, gen: Any, tok: Any) -> None:
        """Append one sampled turn to ``t`` as it is; a turn cut by the budget ends the trajectory."""
        room = gen.max_new_tokens - len(t.response)
        if len(ids) > room:  # the batch's widest budget: this row's own is smaller
            ids, logps, ended = ids[:room], logps[:room], False
        t.response += ids
        t.policy += [1] * len(ids)
        t.logps += logps
        t.counts["turns"] += 1
        t.ended = ended
        content = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        t.messages.append({"role": "assistant", "content": content})
        t.turn_ends.append(len(t.messages))
        if not ended:
            t.done = True
            t.counts["truncated"] += 1

    def reply(self, active: list[Trajectory], tok: Any, gen: Any, last_turn: bool) -> None:
        """The environment's answer to every trajectory that made a turn and is still going: a
        game's ``step`` (on the last turn too: its reward counts), or the turn's tool calls (none: the
        trajectory is complete; on the last turn they are not run)."""
        going = [t for t in active if not t.done]
        jobs: list[tuple[Trajectory, str | None, Callable[[], Any]]] = []
        for t in going:
            text = t.messages[-1]["content"]
            if is_text_environment(t.env):
                jobs.append((t, None, functools.partial(t.env.step, text)))
                continue
            calls = [as_tool_call(c) for c in self.parser(text)]
            if not calls:
                t.done = True  # an answer without a call: the trajectory is complete
            elif not last_turn:
                jobs += [(t, call.name, self.call_job(t, call)) for call in calls]
        replies: dict[int, list[dict[str, Any]]] = {}
        for (t, name, _), (value, failure) in zip(jobs, self.run_jobs([j[2] for j in jobs])):
            message = self.reply_message(t, name, value, failure, tok)
            if message is not None:
                replies.setdefault(id(t), []).append(message)
        for t in going:
            if t.done:
                continue
            if last_turn:
                t.done = True
                t.counts["max_turns"] += 1
            else:
                self.append_reply(t, replies[id(t)], tok, gen)

    def call_job(self, t: Trajectory, call: ToolCall) -> Callable[[], Any]:
        """What running one call means: the tool with its arguments, or the message of a call that
        names no tool of the row's (both counted as malformed)."""
        t.counts["tool_calls"] += 1
        offered = [s["function"]["name"] for s in t.tools]
        if call.error is None and call.name in offered:
            return functools.partial(tool_methods(t.env)[call.name], **call.arguments)
        t.counts["malformed_calls"] += 1
        msg = call.error or f"unknown tool {call.name!r} (tools: {', '.join(offered) or 'none'})"
        return functools.partial(_Reply, f"Error: {msg}")

    def reply_message(
        self, t: Trajectory, name: str | None, value: Any, failure: str | None, tok: Any
    ) -> dict[str, Any] | None:
        """The message a job's outcome becomes (a tool reply, or a game's observation), or None when
        the trajectory ends (a game's ``done``, or its ``step`` failing)."""
        if is_text_environment(t.env):
            if failure is not None:
                t.counts["env_errors"] += 1
                t.reward, t.done = math.nan, True
                return None
            try:
                obs, reward, done = value
                t.reward += float(reward)
            except (TypeError, ValueError):
                t.counts["env_errors"] += 1
                t.reward, t.done = math.nan, True
                return None
            if done or obs is None:
                t.done = True
                return None
            return {"role": "user", "content": self.cut(t, str(obs), tok)}
        if failure == "timeout":
            t.counts["tool_timeouts"] += 1
            text = f"Error: the tool call timed out after {self.settings.tool_timeout_s:g} s"
        elif failure is not None:
            t.counts["tool_errors"] += 1
            text = f"Error: {failure}"
        else:
            text = value.text if isinstance(value, _Reply) else reply_text(value)
        message = {"role": "tool", "content": self.cut(t, text, tok)}
        return {**message, "name": name} if name else message

    def cut(self, t: Trajectory, text: str, tok: Any) -> str:
        """``text`` within ``algo.max_tool_response_tokens``, cut on the named side (counted)."""
        limit = self.settings.max_tool_response_tokens
        if limit is None:
            return text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return text
        t.counts["tool_response_truncated"] += 1
        kept = ids[:limit] if self.settings.tool_response_truncation == "keep_start" else ids[-limit:]
        return tok.decode(kept, skip_special_tokens=False)

    def append_reply(self, t: Trajectory, messages: list[dict[str, Any]], tok: Any, gen: Any) -> None:
        """The environment's turn as the template writes it after the policy's end-of-turn token,
        with the next generation prompt; past the budget the trajectory ends, truncated."""
        ids = tok(self.reply_suffix(tok, messages), add_special_tokens=False)["input_ids"]
        t.messages += messages
        if len(t.response) + len(ids) >= gen.max_new_tokens:  # no room for the policy's next token
            t.done, t.ended = True, False
            t.counts["truncated"] += 1
            return
        t.response += ids
        t.policy += [0] * len(ids)
        t.logps += [0.0] * len(ids)

    # ------------------------------------------------------------- rendering
    @staticmethod
    def render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    def reply_suffix(self, tok: Any, messages: list[dict[str, Any]]) -> str:
        """The text the template writes after an assistant turn's end-of-turn token for ``messages``
        and the next generation prompt: rendered after a fixed one-turn conversation, so that it
        does not depend on how the template treats the earlier turns."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self.render(tok, base, [], False)
        after = self.render(tok, base + messages, [], True)
        end = tok.decode(list(template_facts(tok).end_of_turn), skip_special_tokens=False)
        if not end or not after.startswith(before) or end not in before:
            raise EnvironmentSpecError(
                "the chat template does not render a reply after an assistant turn as an extension of the "
                "conversation closed by an end-of-turn token: multi-turn rollouts cannot append replies"
            )
        return after[before.rindex(end) + len(end) :]

    # ------------------------------------------------------------- tools
    def run_jobs(self, jobs: Sequence[Callable[[], Any]]) -> list[tuple[Any, str | None]]:
        """Each job's (value, None), (None, "timeout") or (None, "<error message>"), run concurrently
        in the tool workers; a job times out ``algo.tool_timeout_s`` after it started, or after
        waiting that long for a free worker. An ``async def`` tool is awaited in its worker."""
        timeout = self.settings.tool_timeout_s
        starts: list[float | None] = [None] * len(jobs)

        def run(i: int) -> Any:
            starts[i] = time.monotonic()
            value = jobs[i]()
            return asyncio.run(value) if inspect.isawaitable(value) else value

        submitted = time.monotonic()
        futures: list[Future] = [self.pool.submit(run, i) for i in range(len(jobs))]
        out: list[tuple[Any, str | None]] = [(None, "timeout")] * len(jobs)
        pending = set(range(len(jobs)))
        while pending:
            wait([futures[i] for i in pending], timeout=0.05, return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for i in sorted(pending):
                f = futures[i]
                if f.done():
                    err = f.exception()
                    out[i] = (None, f"{type(err).__name__}: {err}") if err is not None else (f.result(), None)
                elif now - (starts[i] or submitted) > timeout:
                    f.cancel()  # not started yet: never will; started: left to finish, its result unused
                else:
                    continue
                pending.discard(i)
        return out

    # ------------------------------------------------------------- the end
    def finish(
        self, trajectories: list[Trajectory], tok: Any, pad_id: int, device: Any, with_logps: bool
    ) -> AgentRollout:
        """The environments' rewards, the re-rendering checks, the counts, and the tensors."""
        env_reward = []
        for t in trajectories:
            if not is_text_environment(t.env) and callable(getattr(t.env, "reward", None)):
                try:
                    t.reward = float(t.env.reward())
                except Exception:
                    t.counts["env_errors"] += 1
                    t.reward = math.nan
            env_reward.append(t.reward)
            self.check_rendering(t, tok)
            if callable(getattr(t.env, "close", None)):
                t.env.close()
            t.counts["policy_tokens"] = sum(t.policy)
            t.counts["env_tokens"] = len(t.policy) - sum(t.policy)
            t.counts["trajectories"] = 1
            for k, v in t.counts.items():
                self.stats[k] += v
        prompt_ids, prompt_mask = _left_pad([t.prompt for t in trajectories], pad_id, device)
        width = max(1, max(len(t.response) for t in trajectories))

        def right(values: Callable[[Trajectory], list], fill: float, dtype: torch.dtype) -> Tensor:
            rows = [values(t) + [fill] * (width - len(values(t))) for t in trajectories]
            return torch.tensor(rows, dtype=dtype, device=device)

        texts = []
        for t in trajectories:
            ids = t.response[:-1] if t.ended else t.response
            texts.append(tok.decode(ids, skip_special_tokens=False).strip())
        return AgentRollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=right(lambda t: t.response, pad_id, torch.long),
            response_mask=right(lambda t: t.policy, 0, torch.long),
            attention_mask=right(lambda t: [1] * len(t.response), 0, torch.long),
            ended=torch.tensor([t.ended for t in trajectories], device=device),
            sampler_logprobs=right(lambda t: t.logps, 0.0, torch.float32) if with_logps else None,
            texts=texts,
            env_reward=env_reward,
            tool_calls=[t.counts["tool_calls"] for t in trajectories],
            turns=[t.counts["turns"] for t in trajectories],
            counts=[dict(t.counts) for t in trajectories],
        )

    def check_rendering(self, t: Trajectory, tok: Any) -> None:
        """Count a trajectory whose conversation the template renders differently once it is longer
        (it rewrites earlier turns), and one whose held ids are not the ids of its re-rendering."""
        full = self.render(tok, t.messages, t.tools, False)
        for end in t.turn_ends[:-1]:
            if not full.startswith(self.render(tok, t.messages[:end], t.tools, False)):
                t.counts["template_rewrites"] += 1
                break
        again = tok(full, add_special_tokens=False)["input_ids"]
        held = t.prompt + t.response
        if again[: len(held)] != held:
            t.counts["retokenized"] += 1

    @staticmethod
    def any_rank(n: int, device: Any) -> bool:
        """Whether any rank still has an active trajectory (every rank takes the same branch)."""
        return bool(all_reduce_sum(torch.tensor([float(n)], device=device))[0] > 0)


@dataclass
class _Reply:
    """A reply the loop writes itself (a malformed or unknown call), not a tool's return value."""

    text: str


def _left_pad(rows: list[list[int]], pad_id: int, device: Any) -> tuple[Tensor, Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def check_agent_tokenizer(tokenizer: Any) -> None:
    """A multi-turn rollout renders with the tokenizer's own chat template and needs its end-of-turn token."""
    if not has_chat_template(tokenizer) or not template_facts(tokenizer).end_of_turn:
        raise EnvironmentSpecError(
            "algo.environment needs a tokenizer with a chat template that closes each assistant turn with a "
            "special token (ChatML's <|im_end|>, Llama 3's <|eot_id|>), to render tool turns and append them "
            "to the sampled ids (a learned BPE: model.train_tokenizer.chat_template=chatml)"
        )
