"""Reward scorers: (B,) scores of a rollout's responses, from a frozen reward model
(:class:`ModelScorer`), a Python reward function (:class:`CallableScorer`: the embedded task's gold
reward, the verifiers of lit_rlhf.rewards), or a weighted sum of such functions
(:class:`WeightedScorer`, ``algo.reward_fns``).

Every scorer is called as ``scorer(input_ids, attention_mask, prompts, responses, ended, columns=…)``,
or in two halves: ``pending = scorer.submit(<same arguments>)`` starts the scoring — an ``async``
reward (a remote reward model, an LLM judge, a user's ``async def``) is then in flight in a
background thread (lit_rlhf/utils/aio.py) — and ``pending()`` waits for the (B,) scores; the rollout
runs its reference and policy forwards in between (lit_rlhf/rollout/collect.py). Every scorer
answers :meth:`take_errors` (responses a function could not score, by component name),
:meth:`take_unscored` (how many of those it left NaN on purpose: excused by the health check) and
:meth:`take_outage` (why every endpoint of a remote reward is down, or None).
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
        return self.score_texts(prompts, responses, input_ids.device)

    @torch.no_grad()
    def score_texts(
        self, prompts: Sequence[Any], responses: Sequence[str], device: Any = None, template: Any = None
    ) -> Tensor:
        """(B,) scores of texts, tokenized for the reward model with ``template`` (default: the
        scorer's): the path of a reward model with its own vocabulary, and of the reward server
        (lit_rlhf/serve/server.py)."""
        from lit_rlhf.data.collate import collate_sft, encode_encoder_pair, encode_pair

        encode, template = (
            (encode_encoder_pair if self.model.kind == "encoder" else encode_pair),
            template or self.template,
        )
        if self.model.kind == "encoder" and getattr(template, "name", None) == "auto":
            # an encoder has no chat template: it reads conversations as the HH dialogue text it trains on
            from lit_rlhf.data.chat import get_template, hh_dialogue_text

            prompts, template = [hh_dialogue_text(p) for p in prompts], get_template("dialogue")
        pairs = [encode(self.tokenizer, p, r, template, self.max_length) for p, r in zip(prompts, responses)]
        batch = collate_sft(pairs, self.tokenizer.pad_token_id)
        device = device if device is not None else next(self.model.parameters()).device
        return self.model(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float()

    def submit(self, *args: Any, **kwargs: Any) -> Callable[[], Tensor]:
        """The scores, computed when asked for (a local model has nothing to overlap with)."""
        return lambda: self(*args, **kwargs)

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """A reward model scores every response: nothing to count (see :meth:`CallableScorer.take_errors`)."""
        return {}

    def take_unscored(self) -> int:
        return 0

    def take_outage(self) -> str | None:
        return None


class RewardFunctionError(UserError, RuntimeError):
    """A reward callable failed or returned something that is not one number per response."""


class CallableScorer:
    """Scores from a Python function ``fn(prompts, responses, ended, **columns) -> list[float]``
    (e.g. the embedded task's gold reward, a verifier of lit_rlhf.rewards), on the decoded texts.
    ``columns`` are the rows' dataset columns (the ground truth ``answer`` of a verifiable task,
    docs/rewards.md), passed as keywords the function accepts (by name, or all with ``**kwargs``).
    An ``async def`` function (or an object with an ``async def __call__``) is awaited in a
    background thread from :meth:`submit` on.

    A function that raises, or returns the wrong number of values or non-numbers, stops the run
    with a :class:`RewardFunctionError` naming it; non-finite values are passed on as they are
    (the RL stage counts and skips those samples). A function that scores a response it cannot
    check as 0 — or NaN, and says so in ``last_unscored`` (a remote reward whose endpoint failed) —
    and counts it (``last_errors``, the verifiers do) has those counts summed in :attr:`errors`
    until :meth:`take_errors` reads them; a remote reward's ``outage`` is kept for :meth:`take_outage`.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.errors = self.unscored = 0
        self.error_example: str | None = None
        self.outage: str | None = None
        self._accepts = _keyword_names(fn)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Tensor,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        return self.submit(input_ids, attention_mask, prompts, responses, ended, columns=columns)()

    def submit(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended: Tensor,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Callable[[], Tensor]:
        """Start scoring (an async function: now, in a background thread; a plain one: when the
        returned callable is called) and return the callable that gives the (B,) scores."""
        kwargs = {k: list(v) for k, v in (columns or {}).items() if self._accepts is None or k in self._accepts}
        args = (list(prompts), list(responses), ended.tolist())
        device, n = input_ids.device, len(responses)
        if not self.is_async:
            return lambda: self._finish(self._guarded(lambda: self.fn(*args, **kwargs)), device, n)
        from lit_rlhf.utils import aio

        future = aio.start(self._guarded(lambda: self.fn(*args, **kwargs)), name=f"reward {self.name}")
        return lambda: self._finish(self._guarded(future.result), device, n)

    def _guarded(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:
            raise RewardFunctionError(f"reward function {self.name} raised {type(err).__name__}: {err}") from err

    def _finish(self, values: Any, device: torch.device, n: int) -> Tensor:
        try:
            out = torch.as_tensor(values, dtype=torch.float32, device=device).flatten()
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardFunctionError(
                f"reward function {self.name} returned {type(values).__name__}, not numbers ({err})"
            ) from err
        if out.numel() != n:
            raise RewardFunctionError(f"reward function {self.name} returned {out.numel()} values for {n} responses")
        errors = int(getattr(self.fn, "last_errors", 0) or 0)
        if errors:
            self.errors += errors
            self.error_example = self.error_example or getattr(self.fn, "last_error_example", None)
        self.unscored += int(getattr(self.fn, "last_unscored", 0) or 0)
        self.outage = self.outage or getattr(self.fn, "outage", None)
        return out

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """{short name: (responses the function could not score since the last call of this method
        (scored 0, or NaN when it counts them as unscored), the first error message among them)}."""
        out = {self.name.rsplit(".", 1)[-1]: (self.errors, self.error_example)}
        self.errors, self.error_example = 0, None
        return out

    def take_unscored(self) -> int:
        """Responses left NaN on purpose since the last call (a failed remote request), not a fault
        of the policy's outputs: the health check excuses them (lit_rlhf/modules/health.py)."""
        out, self.unscored = self.unscored, 0
        return out

    def take_outage(self) -> str | None:
        out, self.outage = self.outage, None
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

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.submit(*args, **kwargs)()

    def submit(self, *args: Any, **kwargs: Any) -> Callable[[], Tensor]:
        """Every component's :meth:`CallableScorer.submit` (async ones are in flight together), and
        the callable that sums their scores."""
        pending = [(name, weight, scorer.submit(*args, **kwargs)) for name, weight, scorer in self.parts]

        def total() -> Tensor:
            out = None
            self.components = {}
            for name, weight, result in pending:
                value = result()
                self.components[name] = value
                out = weight * value if out is None else out + weight * value
            return out

        return total

    def take_errors(self) -> dict[str, tuple[int, str | None]]:
        """Per component: responses its function could not score since the last call (see
        :meth:`CallableScorer.take_errors`)."""
        return {name: next(iter(scorer.take_errors().values()), (0, None)) for name, _, scorer in self.parts}

    def take_unscored(self) -> int:
        """Rows some component left NaN on purpose (NaN in one component makes the sum NaN)."""
        return max([scorer.take_unscored() for _, _, scorer in self.parts], default=0)

    def take_outage(self) -> str | None:
        outages = [scorer.take_outage() for _, _, scorer in self.parts]
        return next((o for o in outages if o), None)


def callable_scorer(spec: Mapping[str, Any]) -> CallableScorer:
    """The scorer of one ``{_target_: factory, **kwargs}`` reward (``algo.reward_fn``,
    ``algo.gold_reward_fn``), checked at start by ``modules/configs.py: check_reward_specs``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        fn = instantiate(spec)
    except InstantiationException as err:  # e.g. RemoteReward's check of its settings: say it in one line
        cause = err.__cause__
        if isinstance(cause, UserError):
            raise RewardFunctionError(f"reward {spec['_target_']}: {cause}") from cause
        raise
    return CallableScorer(fn, spec["_target_"])


def weighted_scorer(specs: Sequence[Mapping[str, Any]]) -> WeightedScorer:
    """Σ_k w_k · reward_k of ``algo.reward_fns`` (each ``{_target_, weight: 1.0, name: <factory's name>}``)."""
    parts = []
    for spec in specs:
        spec = dict(spec)
        weight, name = float(spec.pop("weight", 1.0)), spec.pop("name", None)
        parts.append((name or spec["_target_"].rsplit(".", 1)[-1], weight, callable_scorer(spec)))
    return WeightedScorer(parts)
