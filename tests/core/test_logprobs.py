import pytest
import torch

from lit_rlhf.core.logprobs import logprobs_from_logits, shifted_token_logprobs
from lit_rlhf.core.masked import masked_mean, masked_sum


def test_logprobs_hand_computed():
    # logits [0, ln 3] over 2 tokens: p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]]])
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert out.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-6)
    out0 = logprobs_from_logits(logits, torch.tensor([[0]]))
    assert out0.item() == pytest.approx(torch.log(torch.tensor(0.25)).item(), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_logprobs_match_naive_log_softmax(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 11, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 11, (5, 7), generator=g)
    naive = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    got = logprobs_from_logits(logits, labels, chunk_size=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=1e-5)


def test_shifted_logprobs_score_next_token():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g)
    ids = torch.randint(0, 6, (2, 4), generator=g)
    got = shifted_token_logprobs(logits, ids)
    assert got.shape == (2, 4)
    assert torch.all(got[:, 0] == 0)
    for b in range(2):
        for t in range(1, 4):  # naive loop: logits at t-1 predict token t
            expected = logits[b, t - 1].log_softmax(-1)[ids[b, t]]
            assert got[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_masked_sum_and_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_sum(x, m).item() == 4.0
    assert masked_mean(x, m).item() == 2.0
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([2.0, 0.0]))  # empty row -> 0, not NaN
    torch.testing.assert_close(masked_sum(x, m, dim=0), torch.tensor([1.0, 0.0, 3.0]))


def test_masked_sum_ignores_non_finite_padding():
    x = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]])
    m = torch.tensor([[1, 0], [0, 1]])
    assert masked_sum(x, m).item() == 3.0 and masked_mean(x, m).item() == 1.5
