"""The data that flows between RL phases, one field per tensor, each with its shape and mask.

B = rollouts in the batch, P = prompt width (left-padded), R = response width (right-padded
after each response's EOS). Per-token tensors are aligned with the response tokens: column t
holds the quantity for response token t (its log-prob, the value of the state before it, …).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """One batch of generated responses and everything scored on them (no grad).

    ``lit_rlhf.rollout.collect.generate_and_score`` fills a field for every model it is given;
    a field is None only when the algorithm has no such model (``values`` without a critic,
    ``ref_logprobs`` without a reference). An RL module's ``collect`` returns its rollouts with
    every field it uses filled (:meth:`require`).
    """

    prompt_ids: Tensor  # (B, P) left-padded prompt tokens
    prompt_mask: Tensor  # (B, P) 1 = real prompt token
    response_ids: Tensor  # (B, R) generated tokens, right-padded after EOS
    response_mask: Tensor  # (B, R) 1 = a token the policy sampled (up to and including the first EOS): the loss mask
    ended: Tensor  # (B,) bool: the response contains an EOS (False = truncated at max_new_tokens)
    # (B, R) 1 = a real response-side token: the policy's and, in a multi-turn trajectory, the
    # environment's (context for every forward, never trained on); None = response_mask (one turn)
    response_attention_mask: Tensor | None = None
    logprobs: Tensor | None = None  # (B, R) log π_old(y_t | x, y_<t) at rollout time
    ref_logprobs: Tensor | None = None  # (B, R) log π_ref(y_t | x, y_<t); None = no reference model
    sampler_logprobs: Tensor | None = None  # (B, R) the sampling engine's own log-probs of its tokens; None = not kept
    values: Tensor | None = None  # (B, R) V_old(s_t), the critic before this update; None = no critic
    scores: Tensor | None = None  # (B,) raw reward score r(x, y) (reward model or callable), before reparameterization
    baseline_scores: Tensor | None = (
        None  # (B,) score of each row's baseline response (ReMax: the greedy response to its prompt)
    )
    rewards: Tensor | None = None  # (B, R) shaped per-token reward (score on the last token, −β·kl)
    advantages: Tensor | None = None  # (B, R) advantages (whitened if configured)
    returns: Tensor | None = None  # (B, R) critic targets G_t = A_t + V_t
    prompts_text: list[Any] = field(default_factory=list)  # raw prompts: text, or messages with template=auto
    responses_text: list[str] = field(default_factory=list)  # decoded responses
    # per-row dataset columns handed to reward callables with the texts (the ground truth of a
    # verifiable task: {"answer": [...]}; docs/rewards.md); empty = none
    columns: dict[str, list] = field(default_factory=dict)

    def require(self, *names: str) -> Rollout:
        """This rollout, after checking that the named fields are filled (a programming error otherwise)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"rollout is missing {missing}: the collecting module did not compute them")
        return self

    @property
    def input_ids(self) -> Tensor:
        """(B, P + R) prompt and response tokens."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + R) 1 = real token (prompt padding on the left, response padding on the right; a
        multi-turn trajectory's environment tokens are real)."""
        response = self.response_mask if self.response_attention_mask is None else self.response_attention_mask
        return torch.cat([self.prompt_mask, response], dim=1)

    @property
    def valid_mask(self) -> Tensor:
        """(B, R) the response tokens that may train: those of responses whose score is finite
        (a NaN/inf reward is a counted skip, never an update)."""
        if self.scores is None:
            return self.response_mask
        return self.response_mask * torch.isfinite(self.scores).to(self.response_mask.dtype)[:, None]

    @property
    def response_lengths(self) -> Tensor:
        """(B,) response tokens per row the policy sampled (EOS included; a trajectory's environment tokens not)."""
        return self.response_mask.sum(-1)

    def normal_tensors(self) -> Rollout:
        """This rollout with every inference-mode tensor cloned into a normal one (inference
        tensors cannot enter autograd, e.g. as the token ids of a training forward)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and v.is_inference():
                out[f.name] = v.clone()
        return replace(self, **out)

    def select(self, index: Tensor) -> Rollout:
        """The rows ``index`` of every tensor field (a minibatch view)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v[index]
            elif isinstance(v, list) and v:
                out[f.name] = [v[i] for i in index.tolist()]
            elif isinstance(v, dict):
                out[f.name] = {k: [col[i] for i in index.tolist()] for k, col in v.items()}
            else:
                out[f.name] = v
        return replace(self, **out)


def cat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several (e.g. DAPO's resampled groups): prompts re-padded on the LEFT and
    responses on the RIGHT to the widest of each, masks and per-token fields padded with 0.

    Only the fields every part has are kept (the others must be None in all of them).
    """

    def pad_to(x: Tensor, width: int, left: bool, value: float) -> Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        fill = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
        return torch.cat([fill, x] if left else [x, fill], dim=1)

    p_width = max(r.prompt_ids.shape[1] for r in rollouts)
    r_width = max(r.response_ids.shape[1] for r in rollouts)
    out = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in rollouts]
        if f.name in ("prompts_text", "responses_text"):
            out[f.name] = [t for v in values for t in v]
        elif f.name == "columns":
            keys = set(values[0])
            if any(set(v) != keys for v in values):
                raise ValueError(f"cannot concatenate rollouts: their columns differ ({[sorted(v) for v in values]})")
            out[f.name] = {k: [x for v in values for x in v[k]] for k in values[0]}
        elif all(v is None for v in values):
            out[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"cannot concatenate rollouts: {f.name} is missing from some of them")
        elif values[0].dim() == 1:
            out[f.name] = torch.cat(values)
        else:
            prompt_side = f.name.startswith("prompt_")
            value = pad_id if f.name.endswith("_ids") else 0
            width = p_width if prompt_side else r_width
            out[f.name] = torch.cat([pad_to(v, width, prompt_side, value) for v in values])
    return Rollout(**out)
