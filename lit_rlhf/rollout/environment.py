"""What a multi-turn rollout talks to: environments, their tools, and tool calls (docs/agents.md).

An environment is any class, built once per trajectory from ``algo.environment``
(``{_target_: mypkg.envs.Calculator, **kwargs}``). It comes in one of two shapes:

* **Tools** (TRL's ``environment_factory`` shape): its public methods (typed, with a Google-style
  docstring that describes every argument) are the tools shown to the policy, their JSON schemas
  read from the signatures (:func:`tool_schemas`) and passed to the chat template as ``tools=``.
  The policy calls one by writing ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
  (:func:`parse_tool_calls`, replaceable by ``algo.tool_parser``); the return value, as text, is the
  tool's reply. A turn without a call ends the trajectory.
* **Text game**: a class with ``step(self, text) -> (observation, reward, done)`` answers every
  policy turn; ``done`` (or no observation) ends the trajectory, and the step rewards add up.

Both may define ``reset(self, **row) -> str | None`` (the row's dataset columns it names, e.g. the
answer or a secret; a returned string is appended to the prompt's last user turn), ``reward(self)
-> float`` (read once, when the trajectory ends) and ``close(self)``. Methods named ``reset``,
``reward``, ``close`` and ``step`` are never tools.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_rlhf.utils.errors import UserError

#: methods of an environment that are its protocol, never tools
PROTOCOL = ("reset", "reward", "close", "step")
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class EnvironmentSpecError(UserError, ValueError):
    """An environment class that cannot be used (a tool without a schema, a bad ``reset``)."""


@dataclass
class ToolCall:
    """One call the policy wrote: a tool name and its arguments, or why it could not be read."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None  # a malformed call: its reply is this message, and it is counted


def as_tool_call(item: Any) -> ToolCall:
    """What a parser (``algo.tool_parser``) returned for one call, as a :class:`ToolCall`: a ToolCall,
    or a mapping with ``name``, ``arguments`` and optionally ``error`` (parsers need not import this)."""
    if isinstance(item, ToolCall):
        return item
    if isinstance(item, Mapping):
        args = item.get("arguments") or {}
        return ToolCall(item.get("name"), dict(args) if isinstance(args, Mapping) else {}, item.get("error"))
    raise EnvironmentSpecError(
        f"the tool parser returned {type(item).__name__}: expected a ToolCall or a mapping with name and arguments"
    )


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in one policy turn: each ``<tool_call>…</tool_call>`` block holding a JSON object
    ``{"name": str, "arguments": object}`` (``arguments`` may also be a JSON string of one, as some
    models write it). A block whose body is not that, or that is never closed, is a malformed call
    (``error`` set). No block: no call."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, {}, "malformed tool call: <tool_call> is never closed"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, {}, f"malformed tool call: not JSON ({err.msg} at {err.pos})"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCall(None, {}, 'malformed tool call: expected {"name": <tool>, "arguments": {...}}'))
            continue
        calls.append(ToolCall(name, args))
    return calls


def is_text_environment(env: Any) -> bool:
    """Whether ``env`` answers every turn (it has ``step``) rather than tool calls."""
    return callable(getattr(env, "step", None))


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """{name: bound method} of ``env``'s tools: its public methods other than the protocol's,
    in the order its class defines them."""
    if is_text_environment(env):
        return {}
    out = {}
    for name in _public_methods(type(env)):
        out[name] = getattr(env, name)
    return out


def _public_methods(cls: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(cls.__mro__[:-1]):  # base classes first, object left out
        for name, value in vars(klass).items():
            if name.startswith("_") or name in PROTOCOL or name in names:
                continue
            if inspect.isfunction(value) or inspect.iscoroutinefunction(value):
                names.append(name)
    return names


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The JSON schema of every tool of ``env`` (OpenAI's function format, what chat templates take
    as ``tools=``), from each method's signature and docstring (transformers' ``get_json_schema``:
    type hints for the types, the docstring's ``Args:`` for the descriptions)."""
    from transformers.utils import get_json_schema

    out = []
    for name, method in tool_methods(env).items():
        try:
            out.append(get_json_schema(method))
        except Exception as err:
            raise EnvironmentSpecError(
                f"{type(env).__qualname__}.{name}: a tool needs type hints and a docstring describing every "
                f"argument (Google style, 'Args:'): {err}"
            ) from err
    return out


def row_tools(schemas: list[dict[str, Any]], wanted: Any, where: str) -> list[dict[str, Any]]:
    """The tools a row offers: all of ``schemas``, or those its ``tools`` column names (a list of
    names, or of schemas whose function names are taken), in the column's order."""
    if wanted is None:
        return schemas
    if not isinstance(wanted, (list, tuple)):
        raise EnvironmentSpecError(f"{where}: the tools column must be a list of tool names or schemas")
    by_name = {s["function"]["name"]: s for s in schemas}
    out = []
    for item in wanted:
        name = item if isinstance(item, str) else (item.get("function") or item).get("name")
        if name not in by_name:
            raise EnvironmentSpecError(
                f"{where}: tool {name!r} is not one of the environment's ({', '.join(by_name) or 'none'})"
            )
        out.append(by_name[name])
    return out


def reset_environment(env: Any, row: Mapping[str, Any]) -> str | None:
    """``env.reset(**row)`` with the row's columns it names (all with ``**kwargs``); its first
    observation (a string, or None). No ``reset``: None."""
    reset = getattr(env, "reset", None)
    if reset is None:
        return None
    params = inspect.signature(reset).parameters.values()
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    obs = reset(**{k: v for k, v in row.items() if takes_all or k in names})
    if obs is not None and not isinstance(obs, str):
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.reset returned {type(obs).__name__}, not a string or None"
        )
    return obs


def reply_text(value: Any) -> str:
    """A tool's return value as the text of its reply: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
