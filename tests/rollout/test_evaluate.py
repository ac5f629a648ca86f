"""evaluate_verifiable: greedy accuracy, pass@k and mean@k recomputed from what the scorer saw."""

import hashlib

import pytest
import torch

from lit_rlhf.core.passk import pass_at_k
from lit_rlhf.data.prompts import collate_prompts, encode_prompt
from lit_rlhf.data.synthetic import SyntheticTask
from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.rollout.collect import generate_and_score
from lit_rlhf.rollout.config import GenerationConfig
from lit_rlhf.rollout.evaluate import evaluate_verifiable
from lit_rlhf.rollout.scorers import CallableScorer


class Recorder:
    """1.0 for a response whose text hashes odd, 0.0 otherwise; records every (prompt, answer, response)."""

    def __init__(self):
        self.rows = []

    def __call__(self, prompts, responses, ended, answer):
        self.rows += list(zip(prompts, answer, responses))
        return [float(hashlib.md5(r.encode()).digest()[0] % 2) for r in responses]


@pytest.fixture(scope="module")
def policy_and_batch(saved_models, tokenizer):
    policy = build_causal_lm(ModelSpec(name_or_path=saved_models[0]), tokenizer).eval()
    prompts = [r["prompt"] for r in SyntheticTask().prompts(6, "test")]
    items = [(encode_prompt(tokenizer, p, 16)[0], p, {"answer": f"a{i}"}) for i, p in enumerate(prompts)]
    return policy, collate_prompts(items, tokenizer.pad_token_id)


def test_greedy_and_k_samples_are_scored_with_their_prompts_answers(policy_and_batch, tokenizer):
    policy, batch = policy_and_batch
    gen = GenerationConfig(max_new_tokens=6, temperature=1.0)
    rec = Recorder()
    torch.manual_seed(0)
    ev = evaluate_verifiable(policy, batch, tokenizer, gen, CallableScorer(rec), k=4)
    b = len(batch["prompts"])
    assert len(rec.rows) == b + 4 * b
    greedy_rows, sample_rows = rec.rows[:b], rec.rows[b:]
    # every answer is its prompt's; the k samples of a prompt are consecutive rows
    pairs = list(zip(batch["prompts"], batch["columns"]["answer"]))
    assert [(p, a) for p, a, _ in greedy_rows] == pairs
    assert [(p, a) for p, a, _ in sample_rows] == [pa for pa in pairs for _ in range(4)]
    # greedy = the one rollout path with do_sample=False (deterministic)
    again = generate_and_score(policy, batch, tokenizer, GenerationConfig(max_new_tokens=6, do_sample=False))
    assert [r for _, _, r in greedy_rows] == again.responses_text
    odd = lambda r: hashlib.md5(r.encode()).digest()[0] % 2 == 1  # noqa: E731
    correct = [[odd(r) for _, _, r in sample_rows[4 * i : 4 * i + 4]] for i in range(b)]
    m = ev.metrics()
    assert m["greedy_accuracy"] == pytest.approx(sum(odd(r) for _, _, r in greedy_rows) / b)
    assert m["pass@4"] == pytest.approx(sum(pass_at_k(4, sum(c), 4) for c in correct) / b)
    assert m["pass@4"] == pytest.approx(sum(any(c) for c in correct) / b)
    assert m["mean@4"] == pytest.approx(sum(map(sum, correct)) / (4 * b))
    assert m["greedy_length"] == pytest.approx(float(again.response_lengths.float().mean()))
    assert set(ev.metrics()) == {"greedy_accuracy", "greedy_length", "pass@4", "mean@4"}


def test_k_zero_is_greedy_only(policy_and_batch, tokenizer):
    policy, batch = policy_and_batch
    rec = Recorder()
    ev = evaluate_verifiable(policy, batch, tokenizer, GenerationConfig(max_new_tokens=4), CallableScorer(rec), k=0)
    assert len(rec.rows) == len(batch["prompts"]) and set(ev.metrics()) == {"greedy_accuracy", "greedy_length"}


def test_the_samples_kl_to_a_reference_is_the_sum_of_their_log_ratios(policy_and_batch, tokenizer, monkeypatch):
    """With a reference, ``kl`` is the mean over prompts of the mean over their k samples of
    Σ_t log π(y_t) − log π_ref(y_t): recomputed here from full forwards of both models on the
    sampled rows, token by token; the policy against itself is exactly 0."""
    import copy

    import lit_rlhf.rollout.evaluate as evaluate

    policy, batch = policy_and_batch
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen = []
    real = evaluate.generate_and_score
    monkeypatch.setattr(evaluate, "generate_and_score", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    gen = GenerationConfig(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(1)
    ev = evaluate_verifiable(policy, batch, tokenizer, gen, CallableScorer(Recorder()), k=3, reference=reference)
    samples = seen[-1]
    ids, width = samples.input_ids, samples.prompt_ids.shape[1]
    with torch.no_grad():
        lp = torch.log_softmax(policy(input_ids=ids, attention_mask=samples.attention_mask).logits.double(), -1)
        lr = torch.log_softmax(reference(input_ids=ids, attention_mask=samples.attention_mask).logits.double(), -1)
    b, per_row = len(batch["prompts"]), []
    for i in range(ids.shape[0]):
        total = 0.0
        for t in range(samples.response_mask.shape[1]):
            if samples.response_mask[i, t]:
                tok, pos = int(ids[i, width + t]), width + t - 1  # the logits at pos predict the token at pos + 1
                total += float(lp[i, pos, tok] - lr[i, pos, tok])
        per_row.append(total)
    want = sum(sum(per_row[3 * j : 3 * j + 3]) / 3 for j in range(b)) / b
    assert ev.metrics()["kl"] == pytest.approx(want, rel=1e-4, abs=1e-6) and abs(want) > 1e-3
    same = evaluate_verifiable(policy, batch, tokenizer, gen, CallableScorer(Recorder()), k=3, reference=policy)
    assert same.metrics()["kl"] == 0.0
