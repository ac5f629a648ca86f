"""Conversations (``messages``) rendered with the tokenizer's own chat template: ``template: auto``.

Instruct models ship a Jinja chat template, and TRL, OpenRLHF and verl train on ``messages``
(``[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]``) rendered by it.
``data.<section>.template: auto`` does the same in every stage (docs/data.md "Templates"):
SFT trains on the assistant turns of the rendered conversation (:func:`encode_conversation`), the
reward model, DPO and the RL prompts use :class:`TokenizerTemplate` (the same methods as the named
templates of data/templates.py), and rollouts stop at the template's end-of-turn token
(rollout/collect.py). A tokenizer without a template (a base model) renders with
:data:`HH_DIALOGUE_TEMPLATE`.

* :func:`check_messages` validates a conversation (roles, contents, order, empty assistant turns)
  and names the row of a bad one;
* :func:`hh_to_messages` converts an HH-RLHF dialogue string (Human → user, Assistant → assistant);
* :func:`render_with_assistant_mask` renders a conversation and marks the tokens of its assistant
  turns from the template's own rendering, not from string guessing: assistant turn i is the text
  between the rendering of the turns before it with the generation prompt and the rendering that
  includes it (with the template's end-of-turn), mapped to tokens by their character offsets;
* :func:`end_of_turn_ids` finds the special token(s) the template closes an assistant turn with
  (``<|im_end|>``, ``<|eot_id|>``), where generation must stop as well as at EOS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from lit_rlhf.data.collate import EncodedPair
from lit_rlhf.data.io import DataError, require_str
from lit_rlhf.data.templates import AUTO, TEMPLATES
from lit_rlhf.utils.facts import recall

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
#: who may speak after whom: user and assistant alternate; tool replies (one per call of the assistant
#: turn before them) come between an assistant turn and the next (docs/agents.md)
_NEXT = {"user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant")}
Message = dict[str, str]
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_SENTINEL = "LITRLHFSENTINEL"


def check_messages(messages: Any, where: str, ends_with: str | None = None) -> list[Message]:
    """The conversation as a list of ``{"role", "content"}`` dicts, or a :class:`DataError` naming
    ``where`` and the message: each message a mapping with a role of ``system`` / ``user`` /
    ``assistant`` / ``tool`` and a string content; a system message only first; then user and
    assistant turns alternating, starting with user, tool replies between an assistant turn and
    the next; no empty (whitespace-only) assistant turn. ``ends_with``
    ("user" for prompts, "assistant" for SFT conversations) requires the last turn's role."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} needs a role and a content, got {m!r:.80}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} ({role}) content must be a string, got {type(content).__name__}")
        out.append(
            {"role": role, "content": content, **({"name": m["name"]} if role == "tool" and "name" in m else {})}
        )
    turns = out[1:] if out[0]["role"] == "system" else out
    if not turns:
        raise DataError(f"{where}: a system message alone is no conversation")
    previous = None
    for j, m in enumerate(turns):
        i = j + len(out) - len(turns)
        expected = ("user",) if previous is None else _NEXT[previous]
        if m["role"] not in expected:
            what = "a system message is allowed only first" if m["role"] == "system" else "roles out of order"
            raise DataError(
                f"{where}: message {i} is {m['role']}, expected {' or '.join(expected)} ({what}: user and "
                "assistant turns alternate, starting with user; tool replies follow an assistant turn)"
            )
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: message {i} is an empty assistant turn")
        previous = m["role"]
    if ends_with is not None and out[-1]["role"] != ends_with:
        raise DataError(f"{where}: the last message is {out[-1]['role']}, expected {ends_with}")
    return out


def hh_to_messages(dialogue: str, where: str) -> list[Message]:
    """An HH-RLHF dialogue (``"\\n\\nHuman: … \\n\\nAssistant: …"``) as messages: Human → user,
    Assistant → assistant, contents stripped; two turns in a row by one side (9 of the 2,312
    harmless-base rows) become one turn, their texts joined by a blank line; a trailing empty
    ``Assistant:`` (a prompt) is dropped. Checked with :func:`check_messages`."""
    parts = _HH_TURN.split(dialogue)
    if len(parts) < 3 or parts[0].strip():
        raise DataError(f"{where}: not an HH-RLHF dialogue (it must start with '\\n\\nHuman:')")
    if len(parts) > 3 and parts[-2] == "Assistant" and not parts[-1].strip():
        parts = parts[:-2]  # a prompt: the trailing empty "Assistant:" is the generation prompt
    messages: list[Message] = []
    for who, text in zip(parts[1::2], parts[2::2]):
        role = "user" if who == "Human" else "assistant"
        if messages and messages[-1]["role"] == role:  # a few HH rows have two turns in a row by one side
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text.strip()}".strip()
        else:
            messages.append({"role": role, "content": text.strip()})
    return check_messages(messages, where)


HH_DIALOGUE_TEMPLATE = (  # newlines inside expressions: transformers renders with trim_blocks
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '\\n\\nHuman: ' + m['content'] }}"
    "{% else %}{{ '\\n\\nAssistant: ' + m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n\\nAssistant:' }}{% endif %}"
)
"""What ``template=auto`` renders with when the tokenizer ships no chat template (a base model):
Anthropic's "\\n\\nHuman: … \\n\\nAssistant: …" dialogue (the format HH-RLHF and MOSS-RLHF train base
models on), a system message as plain text first; the tokenizer's own special tokens (BOS) are added
as its named templates add them, and a response ends with EOS."""


CHAT_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    # Qwen2.5-Instruct's ChatML layout (no default system turn)
    "chatml": (
        '{% if tools %}<|im_start|>system\n# Tools\n\nYou may call a tool: write <tool_call>{"name": <tool>, '
        '"arguments": {...}}</tool_call>. The tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}'
        "</tools><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        ("<|im_start|>", "<|im_end|>"),
    ),
    # Llama-3-Instruct's header layout
    "llama3": (
        "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
}
"""Chat templates (Jinja, with the special tokens they need) that ``model.train_tokenizer.chat_template``
gives a tokenizer learned from scratch: the layouts of two instruct families, so that the tiny
models train and sample in the same form as a real instruct model."""


def add_chat_template(tokenizer: Any, name: str) -> Any:
    """``tokenizer`` with the special tokens and the Jinja template of :data:`CHAT_TEMPLATES` ``[name]``."""
    jinja, tokens = CHAT_TEMPLATES[name]
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.chat_template = jinja
    return tokenizer


def hh_dialogue_text(prompt: str | list[Message]) -> str:
    """A prompt as the Human/Assistant dialogue text :data:`HH_DIALOGUE_TEMPLATE` renders, ending
    with "\\n\\nAssistant:" (no tokenizer involved): what a reward model trained on dialogue
    strings (an encoder, which has no chat template) reads."""
    return _HH_DIALOGUE_JINJA.render(messages=as_messages(prompt), add_generation_prompt=True)


#: :data:`HH_DIALOGUE_TEMPLATE` compiled once, as transformers compiles a chat template (the encoder
#: reward model renders every rollout's prompt with it)
_HH_DIALOGUE_JINJA = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(HH_DIALOGUE_TEMPLATE)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class _TemplateFacts:
    """What a tokenizer's template writes around an assistant turn (found once per tokenizer)."""

    own: bool
    """The tokenizer's own chat template (False: the HH dialogue fallback)."""
    response_prefix: str
    """Text between the generation prompt and the turn's content (" " for the HH dialogue)."""
    end_of_turn: tuple[int, ...]
    """Special token ids written right after the content (``<|im_end|>``); empty = none."""


def _jinja(tokenizer: Any) -> str:
    return tokenizer.chat_template if has_chat_template(tokenizer) else HH_DIALOGUE_TEMPLATE


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=_jinja(tokenizer), tokenize=False, add_generation_prompt=generation_prompt
    )


def template_facts(tokenizer: Any) -> _TemplateFacts:
    """The response prefix and end-of-turn tokens of the tokenizer's template, found by rendering a
    one-turn conversation around a sentinel answer (found once per tokenizer, kept on it:
    lit_rlhf/utils/facts.py).

    Raises:
        DataError: the template renders the answered turn as something that does not start with
            its generation prompt (responses could not be appended to prompts token by token).
    """
    return recall(tokenizer, "template_facts", lambda: _find_template_facts(tokenizer))


def _find_template_facts(tokenizer: Any) -> _TemplateFacts:
    own = has_chat_template(tokenizer)
    if not own:
        log.warning(
            "the tokenizer has no chat template: template=auto renders conversations as Human/Assistant "
            "dialogues (data/chat.py HH_DIALOGUE_TEMPLATE) and responses end with EOS"
        )
    question = [{"role": "user", "content": "x"}]
    prompt = _render(tokenizer, question, True)
    full = _render(tokenizer, [*question, {"role": "assistant", "content": _SENTINEL}], False)
    if not full.startswith(prompt) or _SENTINEL not in full:
        raise DataError(
            "the chat template does not render an answered turn as its generation prompt followed by the "
            f"answer (prompt {prompt[-40:]!r}, answered {full[-60:]!r}): responses cannot be appended to "
            "prompts; use a named data.*.template"
        )
    at = full.index(_SENTINEL)
    prefix, after = full[len(prompt) : at], full[at + len(_SENTINEL) :]
    special = set(tokenizer.all_special_ids) | {
        i
        for t, i in tokenizer.get_added_vocab().items()
        if getattr(tokenizer.added_tokens_decoder.get(i), "special", False)
    }
    end: list[int] = []
    for tok in tokenizer(after.lstrip(), add_special_tokens=False)["input_ids"]:  # Llama-2-chat: " </s>"
        if tok not in special:
            break
        end.append(tok)
    return _TemplateFacts(own, prefix, tuple(end))


def render_prompt(tokenizer: Any, messages: list[Message]) -> str:
    """The prompt text the model sees: the conversation and the template's generation prompt
    (e.g. ``<|im_start|>assistant\\n``). Tokenize it as :meth:`TokenizerTemplate.prompt_ids` does:
    a tokenizer's own template writes its own BOS."""
    return _render(tokenizer, messages, True)


def render_with_assistant_mask(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask that is 1 on the tokens of its assistant
    turns (each turn's content and what the template writes after it up to the next turn, its
    end-of-turn included) — the SFT loss mask of a multi-turn conversation.

    Raises:
        DataError: the template renders a shorter conversation as something that is not a prefix
            of the longer one (it rewrites earlier turns), so turns cannot be located from it.
    """
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"the chat template does not render turn {i} as a prefix of the conversation: the "
                "assistant turns cannot be located from its rendering"
            )
        spans.append((len(before), len(upto)))
    special = not template_facts(tokenizer).own  # the fallback adds the tokenizer's BOS as named templates do
    enc = tokenizer(full, add_special_tokens=special, return_offsets_mapping=True)
    mask = [int(b > a and any(s <= a < e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token ids the tokenizer's own template writes right after an assistant turn's
    content (for ChatML ``<|im_end|>``, for Llama 3 ``<|eot_id|>``), where generation must stop as
    well as at EOS; empty when it writes none or has no template (EOS alone ends a response)."""
    facts = template_facts(tokenizer)
    return list(facts.end_of_turn) if facts.own else []


def as_messages(prompt: str | list[Message]) -> list[Message]:
    """A prompt as a conversation: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


class TokenizerTemplate:
    """``template: auto``: prompts and responses rendered by the tokenizer's own chat template (the
    HH dialogue of :data:`HH_DIALOGUE_TEMPLATE` when it has none), with the same methods as the
    named templates of data/templates.py. A prompt is a conversation ending with a user turn (a
    string is one user turn); a response is the assistant turn's content, tokenized after the
    template's response prefix and closed by its end-of-turn token(s) (EOS when it writes none):
    exactly what the policy samples after the generation prompt, up to its stop token."""

    name = "auto"

    def prompt_ids(self, tokenizer: Any, prompt: str | list[Message]) -> list[int]:
        text = _render(tokenizer, as_messages(prompt), True)
        return tokenizer(text, add_special_tokens=not template_facts(tokenizer).own)["input_ids"]

    def response_ids(self, tokenizer: Any, response: str) -> list[int]:
        facts = template_facts(tokenizer)
        ids = tokenizer(facts.response_prefix + response, add_special_tokens=False)["input_ids"]
        return ids + self.end_ids(tokenizer)

    def end_ids(self, tokenizer: Any) -> list[int]:
        """The token(s) a response ends with."""
        return list(template_facts(tokenizer).end_of_turn) or [tokenizer.eos_token_id]


def prompt_messages(value: Any, where: str, field: str) -> list[Message]:
    """A conversational prompt (TRL's conversational formats): messages ending with a user turn."""
    return check_messages(value, f"{where}: field '{field}'", ends_with="user")


def completion_text(value: Any, where: str, field: str) -> str:
    """A conversational completion (``[{"role": "assistant", "content": …}]``) as its content."""
    if (
        not isinstance(value, Sequence)
        or isinstance(value, (str, bytes))
        or len(value) != 1
        or not isinstance(value[0], Mapping)
        or value[0].get("role") != "assistant"
    ):
        raise DataError(
            f'{where}: field \'{field}\' must be one assistant message [{{"role": "assistant", '
            f'"content": …}}] (or a string), got {value!r:.80}'
        )
    content = value[0].get("content")
    if not isinstance(content, str):
        raise DataError(f"{where}: field '{field}': the assistant message's content must be a string")
    return content


@contextlib.contextmanager
def naming_row(where: str) -> Iterator[None]:
    """Turn a chat template's refusal to render a row (Jinja's ``raise_exception``: a system turn a
    template does not take, say) into a :class:`DataError` naming the row."""
    try:
        yield
    except jinja2.TemplateError as err:
        raise DataError(f"{where}: the tokenizer's chat template cannot render this row: {err}") from None


def prompt_key(prompt: str | list[Message]) -> str:
    """A hashable key of a prompt (text or conversation): duplicate counts, pairing."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def field_text_or_turns(
    row: Any, field: str, section: str, chat: bool, prompt: bool, hint: Sequence[str] = ()
) -> str | list[Message]:
    """``row.data[field]``: a string, or in TRL's conversational formats a list of messages — a
    prompt (``prompt=True``: messages ending with a user turn) or a completion (one assistant
    message, returned as its content). A conversation needs ``chat`` (template=auto): the error
    names the row, the field and ``data.<section>.template``."""
    value = row.data.get(field)
    if isinstance(value, list):
        if not chat:
            raise DataError(
                f"{row.where}: field '{field}' is a conversation (a list of messages), rendered by the "
                f"tokenizer's chat template: set data.{section}.template=auto"
            )
        return prompt_messages(value, row.where, field) if prompt else completion_text(value, row.where, field)
    return require_str(row, field, hint)


def split_conversations(chosen: Any, rejected: Any, where: str) -> tuple[list[Message], str, str]:
    """TRL's implicit-prompt conversational pair (``chosen`` and ``rejected`` whole conversations)
    → (their shared turns, ending with a user turn, the chosen reply, the rejected reply): both must
    share every turn but a last assistant turn. An empty reply is returned as "" (the caller skips
    and counts it, as for string rows)."""
    prompts = []
    for name, conversation in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(conversation, list) or len(conversation) < 2:
            raise DataError(
                f"{where}: field '{name}' must be a conversation ending with an assistant reply, got "
                f"{conversation!r:.80}"
            )
        prompts.append(check_messages(conversation[:-1], f"{where}: field '{name}'", ends_with="user"))
    if prompts[0] != prompts[1]:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' conversations must share every turn but the last "
            "assistant reply (the prompt)"
        )
    return prompts[0], completion_text(chosen[-1:], where, "chosen"), completion_text(rejected[-1:], where, "rejected")


def encode_conversation(tokenizer: Any, messages: list[Message], max_length: int) -> EncodedPair:
    """A conversation ending with an assistant turn as an SFT pair: the prompt part up to the last
    assistant turn (its earlier assistant turns in ``prompt_loss_mask``), the last turn as the
    response, both from :func:`render_with_assistant_mask`. Over ``max_length`` tokens the prompt
    part loses tokens from the left (its first token, the template's opening, is kept); only a last
    turn that alone does not fit is cut from the right."""
    ids, mask = render_with_assistant_mask(tokenizer, messages)
    end = max(i for i, m in enumerate(mask) if m) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    prompt, loss, response = ids[:start], mask[:start], ids[start:end]
    if not template_facts(tokenizer).end_of_turn:  # the template closes no turn: the response ends with EOS
        response = response + [tokenizer.eos_token_id]
    response_cut = prompt_cut = 0
    if len(response) > max_length - 1:
        response_cut, response = len(response) - (max_length - 1), response[: max_length - 1]
    excess = len(prompt) + len(response) - max_length
    if excess > 0:
        keep = 1 if len(prompt) - excess > 1 else 0
        prompt, loss = prompt[:keep] + prompt[keep + excess :], loss[:keep] + loss[keep + excess :]
        prompt_cut = excess
    return EncodedPair(prompt, response, prompt_cut, response_cut, tuple(loss) if any(loss) else None)


def get_template(name: str) -> Any:
    """The named template (lit_rlhf/data/templates.py), or for ``auto`` the tokenizer's chat template
    (:class:`TokenizerTemplate`)."""
    if name == AUTO:
        return TokenizerTemplate()
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template '{name}'; known: {', '.join([*TEMPLATES, AUTO])}") from None
