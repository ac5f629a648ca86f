"""The training forward (lit_rlhf/rollout/forward.py): response log-probs and logits, padded and
packed, against naive per-sequence forwards."""

import pytest
import torch

from lit_rlhf.data.collate import pad
from lit_rlhf.rollout.forward import response_logprobs

PROMPTS, RESPONSES = [[2, 10, 11], [2, 12], [2, 13, 14, 15]], [[20, 21, 3], [22, 3], [23]]


def prompt_response_batch():
    """Left-padded prompts + right-padded responses, as a rollout lays them out."""
    p_ids, p_mask = pad(PROMPTS, 0, "left")
    r_ids, r_mask = pad(RESPONSES, 0, "right")
    return PROMPTS, RESPONSES, p_ids, r_mask, torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)


@pytest.mark.parametrize("padding_free", [False, True])
def test_response_logprobs_match_naive_and_ignore_padding(policy, padding_free):
    from lit_rlhf.models.packed import packing_verdict

    prompts, responses, p_ids, r_mask, ids, mask = prompt_response_batch()
    with torch.no_grad():
        lp, ent = response_logprobs(policy, ids, mask, p_ids.shape[1], with_entropy=True, padding_free=padding_free)
        if padding_free:
            assert packing_verdict(policy) is True
        for i, (p, r) in enumerate(zip(prompts, responses)):
            full = torch.tensor([p + r])
            logp = policy(input_ids=full).logits[0].log_softmax(-1)
            for t, tok in enumerate(r):
                assert lp[i, t].item() == pytest.approx(logp[len(p) + t - 1, tok].item(), abs=1e-5)
                probs = logp[len(p) + t - 1].exp()
                assert ent[i, t].item() == pytest.approx(-(probs * logp[len(p) + t - 1]).sum().item(), abs=1e-4)


def test_packed_response_logprobs_have_the_padded_gradients(policy):
    """The update's forward (with grad) packed: same gradients of a masked loss as padded."""
    _, _, p_ids, r_mask, ids, mask = prompt_response_batch()
    grads = []
    for padding_free in (False, True):
        lp, _ = response_logprobs(policy, ids, mask, p_ids.shape[1], padding_free=padding_free)
        loss = (lp * r_mask * torch.tensor([[1.0], [-2.0], [0.5]])).sum()
        grads.append(torch.autograd.grad(loss, [p for p in policy.parameters() if p.requires_grad]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_response_logits_same_with_and_without_logits_to_keep(policy):
    """The LM head on the response positions only gives the logits a full forward gives there;
    models whose forward has no ``logits_to_keep`` get the full forward, sliced."""
    from lit_rlhf.rollout.forward import _takes_logits_to_keep, response_logits

    class NoKeep(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    ids, mask = pad([[2, 10, 11, 20, 21, 3], [2, 12, 22, 3]], 0, "left")
    assert _takes_logits_to_keep(policy) and not _takes_logits_to_keep(NoKeep(policy))
    with torch.no_grad():
        kept = response_logits(policy, ids, mask, 3)
        full = response_logits(NoKeep(policy), ids, mask, 3)
        naive = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[
            :, 2:-1
        ]
    assert kept.shape == (2, 3, policy.config.vocab_size)
    torch.testing.assert_close(kept, naive)
    torch.testing.assert_close(full, naive)


def test_truncated_responses_are_scored_with_an_eos_like_the_retokenizing_path(tiny_spec, tokenizer):
    """The reward model reads x + y + EOS (docs/algorithms.md §1). Reusing the policy's ids must give the
    scores that decoding + re-tokenizing (encode_pair appends the EOS) gives, truncated rows too."""
    from lit_rlhf.data.chat import get_template
    from lit_rlhf.models.reward import build_reward_model
    from lit_rlhf.rollout.scorers import ModelScorer, append_eos_to_truncated

    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[pad_id, 7, 8, 20, 21, eos], [4, 5, 6, 22, 23, 24]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ended = torch.tensor([True, False])
    new_ids, new_mask = append_eos_to_truncated(ids, mask, ended, eos, pad_id)
    assert new_ids[:, :6].tolist() == ids.tolist() and new_ids[:, 6].tolist() == [pad_id, eos]
    assert new_mask[:, 6].tolist() == [0, 1]
    assert append_eos_to_truncated(ids, mask, torch.tensor([True, True]), eos, pad_id)[0] is ids

    torch.manual_seed(0)
    rm = build_reward_model(tiny_spec, tokenizer).eval()
    scorer = ModelScorer(rm, tokenizer, tokenizer, get_template("plain"), 64)
    assert scorer.same_vocab
    words = [w for w in tokenizer.get_vocab() if w.isalpha()][:8]
    prompts, responses = [" ".join(words[:2]), " ".join(words[2:5])], [" ".join(words[5:7]), " ".join(words[5:8])]
    p_ids, p_mask = pad([tokenizer(p)["input_ids"] for p in prompts], pad_id, "left")
    r = [tokenizer(x, add_special_tokens=False)["input_ids"] for x in responses]
    r_ids, r_mask = pad([r[0] + [eos], r[1]], pad_id, "right")  # row 0 ended, row 1 truncated
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    fast = scorer(ids, mask, prompts, responses, ended)
    scorer.same_vocab = False
    slow = scorer(ids, mask, prompts, responses, ended)
    torch.testing.assert_close(fast, slow)
    with torch.no_grad():
        no_eos = rm(ids, mask)  # what the old path scored: the truncated row at its last token
    assert abs(float(no_eos[1] - fast[1])) > 1e-4 and abs(float(no_eos[0] - fast[0])) < 1e-5
