import pytest
import torch

from lit_rlhf.core.running_stats import RunningMoments
from lit_rlhf.core.shaping import penalize_missing_eos, reparameterize_scores, shape_rewards


def test_score_sits_on_the_last_response_token_inside_the_mask():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # row 0: EOS at position 2
    r = shape_rewards(torch.tensor([2.0, -1.0]), kl, mask, beta=0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.01, -0.02, 2.0 - 0.03, 0.0], [-0.05, -0.06, -0.07, -1.0 - 0.08]]))
    # beta 0: only the score, exactly on the EOS (not one past it)
    r0 = shape_rewards(torch.tensor([2.0, -1.0]), kl, mask, beta=0.0)
    assert torch.nonzero(r0).tolist() == [[0, 2], [1, 3]]


def test_missing_eos_penalty():
    out = penalize_missing_eos(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 0.5)
    assert out.tolist() == [1.0, 0.5]


def test_reparameterization_updates_moments_before_transforming():
    m = RunningMoments()
    s = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, sample std sqrt(14/3)
    sd = (14 / 3) ** 0.5
    out = reparameterize_scores(s, m, "normalize", clip=None)
    assert out.tolist() == pytest.approx([(v - 3) / sd for v in (1, 2, 3, 6)], rel=1e-5)
    m2 = RunningMoments()
    assert reparameterize_scores(s, m2, "scale", clip=None).tolist() == pytest.approx(
        [v / sd for v in (1, 2, 3, 6)], rel=1e-5
    )
    m3 = RunningMoments()
    clipped = reparameterize_scores(torch.tensor([0.0, 0.0, 0.0, 100.0]), m3, "normalize", clip=1.0)
    assert clipped.max().item() == 1.0 and clipped.min().item() == pytest.approx(-0.5)
    m4 = RunningMoments()
    assert reparameterize_scores(s, m4, "none", clip=2.5).tolist() == [1.0, 2.0, 2.5, 2.5]


def test_overlong_penalty_piecewise():
    """DAPO Eq. 13 with L_max = 16, L_c = 4: 0 up to 12 tokens, linear to −1 at 16, −1 beyond."""
    from lit_rlhf.core.shaping import overlong_penalty

    lengths = torch.tensor([1, 12, 13, 14, 16, 17, 40])
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert overlong_penalty(lengths, 16, 4).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 16, 17)
