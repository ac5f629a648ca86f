"""Reward scorers: (B,) scores of a rollout's responses, from a frozen reward model
(:class:`ModelScorer`), a Python reward function (:class:`CallableScorer`: the embedded task's gold
reward, the verifiers of lit_rlhf.rewards), or a weighted sum of such functions
(:class:`WeightedScorer`, ``algo.reward_fns``).

Every scorer is called as ``scorer(input_ids, attention_mask, prompts, responses, ended, columns=…)``
and answers :meth:`take_errors` (responses a function could not check, by component name).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.utils.errors import UserError


def append_eos_to_truncated(
    input_ids: Tensor, attention_mask: Tensor, ended: Tensor, eos_id: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """(B, T) right-padded sequences → the same with an EOS after every response that has none
    (docs/algorithms.md §1: the reward model reads x + y + EOS; it was never trained on anything else).

    A truncated response ran to the last column, so one extra column holds its EOS; rows that
    ended keep theirs and get a pad there. Without truncated rows the inputs come back as they are.
    """
    if bool(ended.all()):
        return input_ids, attention_mask
    add = ~ended.to(torch.bool)
    col_ids = torch.where(add, torch.full_like(input_ids[:, 0], eos_id), torch.full_like(input_ids[:, 0], pad_id))
    return torch.cat([input_ids, col_ids[:, None]], 1), torch.cat(
        [attention_mask, add.to(attention_mask.dtype)[:, None]], 1
    )


class ModelScorer:
    """Scores (B,) from a frozen reward model. Reuses the policy's token ids when both share a
    tokenizer (with the template's end token — EOS, or the chat template's end-of-turn — appended to
    truncated responses, as the re-tokenizing path and RM training do); otherwise decodes the texts
    and re-tokenizes them for the reward model (an encoder RM with its own vocabulary, for example)
    with ``template`` (data/templates.py; ``auto`` renders with the reward tokenizer's chat template, and an
    encoder, which has none, reads conversations as the HH dialogue text of the named ``dialogue`` template)."""

    def __init__(self, reward_model: Any, reward_tokenizer: Any, policy_tokenizer: Any, template: Any, max_length: int):
        self.model = reward_model
        self.tokenizer = reward_tokenizer
        self.template = template
        self.max_length = max_length
        self.same_vocab = (
            reward_model.kind == "causal_lm" and reward_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        )

    @torch.no_grad()
    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Tensor,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        """(B,) scores; ``columns`` (the rows' dataset columns) are not read by a reward model."""
        if self.same_vocab:  # a truncated response gets the end token its template closes responses with
            end = self.template.end_ids(self.tokenizer)[0] if self.template is not None else self.tokenizer.eos_token_id
            ids, mask = append_eos_to_truncated(input_ids, attention_mask, ended, end, self.tokenizer.pad_token_id)
            return self.model(ids, mask).float()
        from lit_rlhf.data.collate import collate_sft, encode_encoder_pair, encode_pair

        encode, template = (encode_encoder_pair if self.model.kind == "encoder" else encode_pair), self.template
        if self.model.kind == "encoder" and getattr(template, "name", None) == "auto":
            # an encoder has no chat template: it reads conversations as the HH dialogue text it trains on
            from lit_rlhf.data.chat import get_template, hh_dialogue_text

            prompts, template = [hh_dialogue_text(p) for p in prompts], get_template("dialogue")
        pairs = [encode(self.tokenizer, p, r, template, self.max_length) for p, r in zip(prompts, responses)]
        batch = collate_sft(pairs, self.tokenizer.pad_token_id)
        device = input_ids.device
        return self.model(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float()

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """A reward model scores every response: nothing to count (see :meth:`CallableScorer.take_errors`)."""
        return {}


class RewardFunctionError(UserError, RuntimeError):
    """A reward callable failed or returned something that is not one number per response."""


class CallableScorer:
    """Scores from a Python function ``fn(prompts, responses, ended, **columns) -> list[float]``
    (e.g. the embedded task's gold reward, a verifier of lit_rlhf.rewards), on the decoded texts.
    ``columns`` are the rows' dataset columns (the ground truth ``answer`` of a verifiable task,
    docs/rewards.md), passed as keywords the function accepts (by name, or all with ``**kwargs``).

    A function that raises, or returns the wrong number of values or non-numbers, stops the run
    with a :class:`RewardFunctionError` naming it; non-finite values are passed on as they are
    (the RL stage counts and skips those samples). A function that scores a response it cannot
    check as 0 and counts it (``last_errors``, the verifiers do) has those counts summed in
    :attr:`errors` until :meth:`take_errors` reads them.
    """

    def __init__(self, fn: Callable[..., Sequence[float]], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.errors = 0
        self.error_example: str | None = None
        self._accepts = _keyword_names(fn)

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Tensor,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        kwargs = {k: list(v) for k, v in (columns or {}).items() if self._accepts is None or k in self._accepts}
        try:
            values = self.fn(list(prompts), list(responses), ended.tolist(), **kwargs)
        except Exception as err:
            raise RewardFunctionError(f"reward function {self.name} raised {type(err).__name__}: {err}") from err
        try:
            out = torch.as_tensor(values, dtype=torch.float32, device=input_ids.device).flatten()
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardFunctionError(
                f"reward function {self.name} returned {type(values).__name__}, not numbers ({err})"
            ) from err
        if out.numel() != len(responses):
            raise RewardFunctionError(
                f"reward function {self.name} returned {out.numel()} values for {len(responses)} responses"
            )
        errors = int(getattr(self.fn, "last_errors", 0) or 0)
        if errors:
            self.errors += errors
            self.error_example = self.error_example or getattr(self.fn, "last_error_example", None)
        return out

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """{short name: (responses the function could not check since the last call of this method
        (scored 0), the first error message among them)}."""
        out = {self.name.rsplit(".", 1)[-1]: (self.errors, self.error_example)}
        self.errors, self.error_example = 0, None
        return out


def _keyword_names(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names ``fn`` takes beyond (prompts, responses, ended); None = any (``**kwargs``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class WeightedScorer:
    """Σ_k w_k · scorer_k: several rewards combined (``algo.reward_fns``); the last call's
    unweighted components stay in ``components`` (name -> (B,)) for logging as ``reward/<name>``."""

    def __init__(self, parts: Sequence[tuple[str, float, Any]]):
        self.parts = list(parts)
        self.components: dict[str, Tensor] = {}

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Tensor,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        total = None
        self.components = {}
        for name, weight, scorer in self.parts:
            value = scorer(input_ids, attention_mask, prompts, responses, ended, columns=columns)
            self.components[name] = value
            total = weight * value if total is None else total + weight * value
        return total

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """Per component: responses its function could not check since the last call (see
        :meth:`CallableScorer.take_errors`)."""
        return {name: next(iter(scorer.take_errors().values()), (0, None)) for name, _, scorer in self.parts}


def callable_scorer(spec: Mapping[str, Any]) -> CallableScorer:
    """The scorer of one ``{_target_: factory, **kwargs}`` reward (``algo.reward_fn``,
    ``algo.gold_reward_fn``), checked at start by ``modules/configs.py: check_reward_specs``."""
    from hydra.utils import instantiate

    return CallableScorer(instantiate(spec), spec["_target_"])


def weighted_scorer(specs: Sequence[Mapping[str, Any]]) -> WeightedScorer:
    """Σ_k w_k · reward_k of ``algo.reward_fns`` (each ``{_target_, weight: 1.0, name: <factory's name>}``)."""
    parts = []
    for spec in specs:
        spec = dict(spec)
        weight, name = float(spec.pop("weight", 1.0)), spec.pop("name", None)
        parts.append((name or spec["_target_"].rsplit(".", 1)[-1], weight, callable_scorer(spec)))
    return WeightedScorer(parts)
