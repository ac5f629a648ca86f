"""The tables of training objectives: each loss variant a config can name, the function of
:mod:`lit_rlhf.core.losses` that computes it, and what it reads.

* :data:`PAIR_LOSSES` — ``algo.loss_type`` of the DPO family (docs/algorithms.md §5): whether the
  loss needs the frozen reference, whether it reads the policy's summed or length-averaged
  sequence log-probs, which ``algo.*`` values it takes, and whether it trains on pairs or on
  unpaired examples (KTO);
* :data:`POLICY_LOSSES` — ``algo.policy_loss`` of every RL stage: the per-token policy-gradient
  objective (docs/algorithms.md §2.6);
* :data:`AGGREGATIONS` — ``algo.loss_aggregation``: how a per-token loss becomes a scalar
  (docs/algorithms.md §6).

A new variant is a function in ``core/losses.py``, an entry here and, where it is a recipe, a
preset in ``lit_rlhf/conf/algo/``: the configs validate their names against these tables, the modules call
through them, and nothing branches on the names elsewhere. This file imports nothing (no torch), so
a config is checked before any framework is loaded.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


def _losses_function(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module("lit_rlhf.core.losses"), name)


@dataclass(frozen=True)
class PairLoss:
    """A preference loss. Paired losses are called as ``fn(chosen, rejected, [ref_chosen,
    ref_rejected,] **params)`` on (B,) sequence log-probs and return ``(loss, stats)`` with (B,)
    ``chosen_rewards`` and ``rejected_rewards`` (their implicit rewards) among the stats."""

    function: str
    """Its function in lit_rlhf/core/losses.py."""
    reference: bool
    """Reads the frozen reference's log-probs (False: no reference model is built at all)."""
    logps: Literal["sum", "mean"]
    """The policy's sequence log-probs it reads: summed over the response tokens, or their mean."""
    params: tuple[str, ...]
    """The ``algo.*`` values it takes, passed by keyword under the same names."""
    paired: bool = True
    """False: unpaired desirable / undesirable examples (KTO; the data module splits pairs)."""
    section: str = "§5"
    """Its section of docs/algorithms.md."""

    @property
    def fn(self) -> Callable[..., Any]:
        return _losses_function(self.function)


PAIR_LOSSES: dict[str, PairLoss] = {
    # DPO (Rafailov et al. 2023); cDPO with label_smoothing > 0 (Mitchell 2023)
    "sigmoid": PairLoss("dpo_sigmoid_loss", True, "sum", ("beta", "label_smoothing")),
    # IPO (Azar et al. 2023)
    "ipo": PairLoss("ipo_loss", True, "sum", ("beta",)),
    # SimPO (Meng et al. 2024): reference-free, length-averaged
    "simpo": PairLoss("simpo_loss", False, "mean", ("beta", "gamma_beta_ratio", "label_smoothing"), section="§5.1"),
    # ORPO (Hong et al. 2024): reference-free, length-averaged; beta is its λ
    "orpo": PairLoss("orpo_loss", False, "mean", ("beta",), section="§5.2"),
    # KTO (Ethayarajh et al. 2024): unpaired examples around the reference point
    "kto": PairLoss(
        "kto_loss", True, "sum", ("beta", "desirable_weight", "undesirable_weight"), paired=False, section="§5.3"
    ),
}


@dataclass(frozen=True)
class PolicyLoss:
    """A policy-gradient objective, called as ``fn(logprobs, old_logprobs, advantages,
    response_mask, clip_low, clip_high, dual_clip, aggregation, agg_constant, is_weights, normalizer)``
    on (B, T) tensors; returns ``(loss, stats)`` (stats named without the ``policy/`` prefix)."""

    function: str
    """Its function in lit_rlhf/core/losses.py."""
    section: str
    """Its section of docs/algorithms.md."""
    dual_clip: bool = False
    """Takes ``algo.dual_clip`` (the others refuse it)."""
    per_response: bool = False
    """Reads one advantage per response (a sequence-level objective): the critic-free stages only."""
    ordered_clip: bool = True
    """Its clip range is PPO's ratio range, so ``clip_eps_high >= clip_eps_low`` (clip-higher) is
    checked; CISPO's weight bounds are free."""
    options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments its function is called with beyond the common ones (GSPO-token's level)."""

    @property
    def fn(self) -> Callable[..., Any]:
        fn = _losses_function(self.function)
        return functools.partial(fn, **dict(self.options)) if self.options else fn


POLICY_LOSSES: dict[str, PolicyLoss] = {
    # PPO's clipped surrogate (Schulman et al. 2017), with clip-higher (DAPO) and dual clip (Ye et al. 2020)
    "clip": PolicyLoss("ppo_policy_loss", "§2.6", dual_clip=True),
    # GSPO (Zheng et al. 2025): the response's ratio (geometric mean of its tokens') in the clipped surrogate
    "gspo": PolicyLoss("gspo_policy_loss", "§6.3", per_response=True),
    # GSPO-token (Zheng et al. 2025, Eq. 13): the response's ratio, each token's own gradient and advantage
    "gspo_token": PolicyLoss("gspo_policy_loss", "§6.3", options=(("token_level", True),)),
    # CISPO (MiniMax-M1, 2025): the clipped, stop-gradient importance weight times log π
    "cispo": PolicyLoss("cispo_policy_loss", "§6.3", ordered_clip=False),
    # GMPO (Zhao et al. 2025): the geometric mean of the token ratios, clipped per token in log space
    "gmpo": PolicyLoss("gmpo_policy_loss", "§6.3", per_response=True),
}


CORRECTIONS: dict[str, str] = {
    "none": "no correction: the sampler's tokens are taken as the trainer's",
    "tis": "min(r_t, C) per token: truncated importance sampling (Yao et al. 2025) = token_truncate",
    "token_truncate": "min(r_t, C) per token",
    "token_mask": "r_t per token, 0 where r_t > C",
    "decoupled": "r_t per token, uncapped: decoupled PPO's behaviour weight π_prox/μ (Hilton et al. 2022)",
    "sequence_truncate": "min(R_i, C) for every token of response i, R_i the product of its token ratios",
    "sequence_mask": "R_i for every token of response i, 0 where R_i > C",
    "icepop": "r_t inside the band [low, high], 0 outside (IcePop)",
    "geo_mask": "1 where the response's geometric-mean ratio is inside the band, else 0 for the whole response",
}
"""``algo.rollout_correction`` → the weight it gives each token's policy-gradient term, with the
trainer-over-sampler ratios r_t (lit_rlhf/core/mismatch.py: ``correction_weights``; docs/algorithms.md §2.10)."""


AGGREGATIONS: dict[str, str] = {
    "token_mean": "Σ m·l / Σ m: every token of the batch weighs the same (PPO, DAPO)",
    "seq_mean_token_mean": "the mean over sequences of each sequence's token mean (GRPO, as TRL)",
    "seq_sum_constant": "Σ m·l / (B · max_new_tokens): a constant normaliser (Dr. GRPO)",
}
"""``algo.loss_aggregation`` → what it computes (lit_rlhf/core/losses.py: ``aggregate``)."""


def check_name(table: dict[str, Any], name: str) -> str | None:
    """None when ``name`` is a key of ``table``, else the error message a config reports."""
    return None if name in table else f"must be one of {list(table)}, got {name!r}"
