"""The chat template shared by SFT, RM and PPO (docs/algorithms.md §1: one template for every stage).

A template turns a raw prompt into the text the model sees, and says what goes in front of a
response. Stages tokenize the formatted prompt (with the tokenizer's special tokens, e.g. BOS)
and the response (without) separately and concatenate the ids, so a response always starts
on a token boundary whatever the tokenizer merges.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatTemplate:
    prompt_format: str = "{prompt}"
    """Python format string with ``{prompt}``."""
    response_prefix: str = ""
    """Text put before every response (e.g. the space after "Assistant:")."""

    def format_prompt(self, prompt: str) -> str:
        return self.prompt_format.format(prompt=prompt)

    def format_response(self, response: str) -> str:
        return self.response_prefix + response


TEMPLATES: dict[str, ChatTemplate] = {
    # the embedded task: prompts are sentence openings, responses their continuation
    "plain": ChatTemplate(),
    # single-turn Anthropic HH style, for raw questions
    "human_assistant": ChatTemplate("\n\nHuman: {prompt}\n\nAssistant:", " "),
    # prompts that already end with "\n\nAssistant:" (HH-RLHF dialogues)
    "dialogue": ChatTemplate("{prompt}", " "),
}


def get_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template '{name}'; known: {', '.join(TEMPLATES)}") from None
