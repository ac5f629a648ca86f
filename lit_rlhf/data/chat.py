"""Conversations (``messages``) rendered with the tokenizer's own chat template.

``data.sft.template: auto`` trains on conversations rendered by the tokenizer's chat template
(:func:`encode_conversation`); the preference and prompt data and the rollout's stop at the
template's end-of-turn do not use it yet.
instruct models ship a Jinja chat template, and TRL, OpenRLHF and verl train on ``messages``
(``[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]``) rendered by it.

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

import re
from typing import Any, Mapping, Sequence

from lit_rlhf.data.collate import EncodedPair
from lit_rlhf.data.io import DataError

ROLES = ("system", "user", "assistant")
Message = dict[str, str]
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_SENTINEL = "LITRLHFSENTINEL"


def check_messages(messages: Any, where: str, ends_with: str | None = None) -> list[Message]:
    """The conversation as a list of ``{"role", "content"}`` dicts, or a :class:`DataError` naming
    ``where`` and the message: each message a mapping with a role of ``system`` / ``user`` /
    ``assistant`` and a string content; a system message only first; then user and assistant turns
    alternating, starting with user; no empty (whitespace-only) assistant turn. ``ends_with``
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
        out.append({"role": role, "content": content})
    turns = out[1:] if out[0]["role"] == "system" else out
    if not turns:
        raise DataError(f"{where}: a system message alone is no conversation")
    for j, m in enumerate(turns):
        i = j + len(out) - len(turns)
        expected = "user" if j % 2 == 0 else "assistant"
        if m["role"] != expected:
            what = "a system message is allowed only first" if m["role"] == "system" else "roles out of order"
            raise DataError(f"{where}: message {i} is {m['role']}, expected {expected} ({what}: user and "
                            "assistant turns alternate, starting with user)")  # fmt: skip
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: message {i} is an empty assistant turn")
    if ends_with is not None and out[-1]["role"] != ends_with:
        raise DataError(f"{where}: the last message is {out[-1]['role']}, expected {ends_with}")
    return out


def hh_to_messages(dialogue: str, where: str) -> list[Message]:
    """An HH-RLHF dialogue (``"\\n\\nHuman: … \\n\\nAssistant: …"``) as messages: Human → user,
    Assistant → assistant, contents stripped; a trailing empty ``Assistant:`` (a prompt) is dropped.
    Checked with :func:`check_messages`."""
    parts = _HH_TURN.split(dialogue)
    if len(parts) < 3 or parts[0].strip():
        raise DataError(f"{where}: not an HH-RLHF dialogue (it must start with '\\n\\nHuman:')")
    messages = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
                for who, text in zip(parts[1::2], parts[2::2])]  # fmt: skip
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return check_messages(messages, where)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def render_prompt(tokenizer: Any, messages: list[Message]) -> str:
    """The prompt text the model sees: the conversation and the template's generation prompt
    (e.g. ``<|im_start|>assistant\\n``). Tokenize it with ``add_special_tokens=False``: templates
    write their own BOS."""
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
            raise DataError(f"the chat template does not render turn {i} as a prefix of the conversation: the "
                            "assistant turns cannot be located from its rendering")  # fmt: skip
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token ids the template writes right after an assistant turn's content (for
    ChatML ``<|im_end|>``, for Llama 3 ``<|eot_id|>``); empty when it writes none (EOS alone ends a
    response). Found by rendering a one-turn conversation around a sentinel answer."""
    text = _render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], False)
    after = text[text.index(_SENTINEL) + len(_SENTINEL):]
    special = set(tokenizer.all_special_ids) | {i for t, i in tokenizer.get_added_vocab().items()
                                                if getattr(tokenizer.added_tokens_decoder.get(i), "special", False)}  # fmt: skip
    out = []
    for tok in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if tok not in special:
            break
        out.append(tok)
    return out


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
    response_cut = prompt_cut = 0
    if len(response) > max_length - 1:
        response_cut, response = len(response) - (max_length - 1), response[: max_length - 1]
    excess = len(prompt) + len(response) - max_length
    if excess > 0:
        keep = 1 if len(prompt) - excess > 1 else 0
        prompt, loss = prompt[:keep] + prompt[keep + excess :], loss[:keep] + loss[keep + excess :]
        prompt_cut = excess
    return EncodedPair(prompt, response, prompt_cut, response_cut, tuple(loss) if any(loss) else None)
