"""Evaluation of a verifiable task on one prompt batch: greedy accuracy, pass@k, mean@k, length, and
the KL of the samples to a reference policy.

One implementation for the RL stages' validation (``algo.val_pass_k``: ``val/greedy_accuracy``,
``val/pass@k``, ``val/mean@k``) and the reasoning pipeline's table (lit_rlhf/pipelines/demo.py). A
response is correct when its score (the gold reward when the stage has one, else the reward)
reaches ``correct_at`` (1.0 for a 0/1 verifier such as lit_rlhf.rewards.exact_match). pass@k
is the unbiased estimator of Chen et al. (2021) from k samples per problem (docs/rewards.md):
with n = k samples it is the fraction of problems with at least one correct sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.core.kl import sequence_kl
from lit_rlhf.core.passk import mean_at_k, pass_at_k_batch
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.rollout.config import GenerationConfig


@dataclass
class VerifiableEval:
    """Per prompt of the batch: the greedy response's correctness and length (B,), the
    correctness of k sampled responses (B, k), and with a reference their mean KL (B,)."""

    greedy_correct: Tensor
    greedy_length: Tensor
    sample_correct: Tensor
    sample_kl: Tensor | None = None  # (B,) mean over the k samples of Σ_t log π/π_ref (nats per response)
    greedy_tool_calls: Tensor | None = None  # (B,) the greedy trajectory's tool calls (multi-turn only)
    greedy_texts: list[str] | None = None  # the greedy responses (trajectories)

    @classmethod
    def cat(cls, parts: list[VerifiableEval]) -> VerifiableEval:
        """The evaluation of several batches as one (their prompts in order)."""

        def joined(name: str) -> Any:
            values = [getattr(p, name) for p in parts]
            if values[0] is None:
                return None
            return [x for v in values for x in v] if isinstance(values[0], list) else torch.cat(values)

        return cls(*(joined(f.name) for f in fields(cls)))

    def metrics(self) -> dict[str, float]:
        """Means over the batch's prompts: pass@k and mean@k by lit_rlhf.core.passk from the k
        samples of each prompt (with n = k samples, pass@k is the share of prompts with a correct one)."""
        k = self.sample_correct.shape[1]
        out = {
            "greedy_accuracy": float(self.greedy_correct.float().mean()),
            "greedy_length": float(self.greedy_length.float().mean()),
        }
        if k:
            rows = self.sample_correct.tolist()
            out[f"pass@{k}"] = pass_at_k_batch(rows, k)
            out[f"mean@{k}"] = mean_at_k(rows)
        if self.sample_kl is not None:
            out["kl"] = float(self.sample_kl.float().mean())
        if self.greedy_tool_calls is not None:
            out["greedy_tool_calls"] = float(self.greedy_tool_calls.mean())
        return out


@torch.no_grad()
def evaluate_verifiable(
    policy: Any,
    batch: Mapping[str, Any],
    tokenizer: Any,
    gen: GenerationConfig,
    scorer: Any,
    k: int,
    correct_at: float = 1.0,
    padding_free: bool = False,
    engine: Any = None,
    reference: Any = None,
    agent: Any = None,
) -> VerifiableEval:
    """Greedy decoding of every prompt of ``batch`` (``gen`` with ``do_sample=False``) and ``k``
    samples per prompt with ``gen`` (one request of k rows per prompt), scored by ``scorer`` with
    the batch's columns (the ground truth) through the one rollout path (``engine``: its sampler,
    None = the hf loop). With a ``reference`` model, the samples' KL(π‖π_ref): the exact k1 sum of
    log-ratios of each sampled response (:func:`lit_rlhf.core.kl.sequence_kl`, unclamped, as
    ``stability/kl``), averaged over a prompt's k samples. With an ``agent`` every response is a
    multi-turn trajectory (rollout/agent.py), and ``greedy_tool_calls`` counts the greedy one's calls."""
    greedy = generate_and_score(
        policy,
        batch,
        tokenizer,
        replace(gen, do_sample=False),
        scorer=scorer,
        policy_logprobs=False,
        padding_free=padding_free,
        engine=engine,
        agent=agent,
    )
    b, sample_kl = greedy.scores.shape[0], None
    if k:
        samples = generate_and_score(
            policy,
            batch,
            tokenizer,
            gen,
            scorer=scorer,
            padding_free=padding_free,
            engine=engine,
            responses_per_prompt=k,
            reference=reference,
            policy_logprobs=reference is not None,
            agent=agent,
        )
        sample_correct = (samples.scores >= correct_at).view(b, k)
        if reference is not None:
            kl = sequence_kl(samples.logprobs, samples.ref_logprobs, samples.response_mask, "k1", clamp=None)
            sample_kl = kl.view(b, k).mean(1).cpu()
    else:
        sample_correct = torch.zeros(b, 0, dtype=torch.bool)
    calls = greedy.columns.get("tool_calls")
    calls = torch.tensor(calls, dtype=torch.float32) if calls is not None else None
    return VerifiableEval(
        greedy.scores >= correct_at,
        greedy.response_lengths,
        sample_correct.cpu(),
        sample_kl,
        calls,
        greedy.responses_text,
    )
