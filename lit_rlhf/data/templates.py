"""The prompt templates shared by SFT, RM, DPO and the RL stages (docs/algorithms.md §1: one
template for every stage).

A template turns a raw prompt into the token ids the model sees, and a response into the ids that
follow them: stages tokenize the prompt and the response separately and concatenate the ids, so a
response always starts on a token boundary whatever the tokenizer merges, exactly as the policy
samples it after the prompt. The named templates here are Python format strings for base models
and the embedded tasks; ``auto`` is the tokenizer's own chat template (data/chat.py:
:class:`~lit_rlhf.data.chat.TokenizerTemplate`), with the same three methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    def prompt_ids(self, tokenizer: Any, prompt: str) -> list[int]:
        """The formatted prompt's ids, with the tokenizer's special tokens (e.g. BOS)."""
        return self.prompt_ids_batch(tokenizer, [prompt])[0]

    def response_ids(self, tokenizer: Any, response: str) -> list[int]:
        """The response's ids after the prefix, ending with EOS."""
        return self.response_ids_batch(tokenizer, [response])[0]

    def prompt_ids_batch(self, tokenizer: Any, prompts: list[str]) -> list[list[int]]:
        """:meth:`prompt_ids` of many prompts in one tokenizer call (the same ids: each text is encoded
        on its own; a call's fixed cost is most of a short row's time)."""
        for prompt in prompts:
            if not isinstance(prompt, str):
                raise ValueError(
                    "a conversation (a list of messages) is rendered by the tokenizer's chat template: "
                    "set the data section's template=auto"
                )
        if not prompts:
            return []
        return tokenizer([self.format_prompt(p) for p in prompts], add_special_tokens=True)["input_ids"]

    def response_ids_batch(self, tokenizer: Any, responses: list[str]) -> list[list[int]]:
        """:meth:`response_ids` of many responses in one tokenizer call."""
        if not responses:
            return []
        eos, end = tokenizer.eos_token_id, self.end_ids(tokenizer)
        encoded = tokenizer([self.format_response(r) for r in responses], add_special_tokens=False)["input_ids"]
        return [ids if ids and ids[-1] == eos else ids + end for ids in encoded]

    def end_ids(self, tokenizer: Any) -> list[int]:
        """The token(s) a response ends with: EOS."""
        return [tokenizer.eos_token_id]


TEMPLATES: dict[str, ChatTemplate] = {
    # the embedded task: prompts are sentence openings, responses their continuation
    "plain": ChatTemplate(),
    # no template: the prompt's text as it is (the same as plain)
    "none": ChatTemplate(),
    # single-turn Anthropic HH style, for raw questions
    "human_assistant": ChatTemplate("\n\nHuman: {prompt}\n\nAssistant:", " "),
    # prompts that already end with "\n\nAssistant:" (HH-RLHF dialogues)
    "dialogue": ChatTemplate("{prompt}", " "),
}
AUTO = "auto"
"""The tokenizer's own chat template (data/chat.py)."""
