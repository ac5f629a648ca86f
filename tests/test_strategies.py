"""lit_rlhf/utils/strategies.py without processes: the FSDP strategy's refusals, the gradient-norm
clip it uses (against torch's own), and the shape rule the optimizer groups read. The strategies'
real runs (FSDP, ZeRO-2/3 on 2 CPU processes) are in tests/test_distributed.py."""

import pytest
import torch

from lit_rlhf.modules.health import clip_by_norm
from lit_rlhf.utils.strategies import RLHFFSDPStrategy, built_ndim, sharded_grad_norm

LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _params_with_grads(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((16, 8), (8,), (5, 3, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: ignored
    return params


@pytest.mark.parametrize("scale, max_norm", [(1.0, 0.5), (1.0, 100.0), (1e-3, 1.0)])
def test_norm_and_clip_equal_torch_clip_grad_norm(scale, max_norm):
    """Unsharded (gradients already whole): the norm and the scaled gradients are torch's."""
    ours, theirs = _params_with_grads(0, scale), _params_with_grads(0, scale)
    norm = sharded_grad_norm(ours, RLHFFSDPStrategy(wrap_layers=[LAYER], sharding_strategy="NO_SHARD"))
    clip_by_norm(ours, norm, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert ours[3].grad is None


def test_norm_of_shards_is_the_norm_of_the_whole():
    """Each rank holds disjoint pieces: the squares add up across ranks (simulated here by summing
    the per-"rank" squared norms, which is what the all-reduce does)."""
    whole = torch.randn(40)
    pieces = [whole[:13], whole[13:13], whole[13:]]  # an empty shard too
    per_rank = [float(sharded_grad_norm([_with_grad(p)], _Local())) ** 2 for p in pieces]
    assert sum(per_rank) ** 0.5 == pytest.approx(float(whole.norm()), rel=1e-6)


class _Local:
    shards_gradients = False
    root_device = torch.device("cpu")


def _with_grad(t: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(t))
    p.grad = t.clone()
    return p


def test_norm_without_gradients_is_zero():
    assert float(sharded_grad_norm([torch.nn.Parameter(torch.zeros(2))], _Local())) == 0.0


def test_fsdp_strategy_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="wrap_layers"):
        RLHFFSDPStrategy(wrap_layers=[LAYER], auto_wrap_policy={torch.nn.Linear})
    with pytest.raises(ValueError, match="sharding_strategy: hybrid"):
        RLHFFSDPStrategy(wrap_layers=[LAYER], sharding_strategy="HYBRID_SHARD")
    s = RLHFFSDPStrategy(wrap_layers=[LAYER], sharding_strategy="SHARD_GRAD_OP")
    assert not s.wrapped  # nothing set up: sampling does not gather

    class Shared(torch.nn.Module):  # a LoRA reference registers the actor under a second parent
        def __init__(self):
            super().__init__()
            self.actor = torch.nn.Linear(2, 2)
            self.reference = torch.nn.Sequential(self.actor)

    with pytest.raises(ValueError, match="'actor' is also registered as 'reference.0'"):
        s._setup_model(Shared())

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match="Own holds parameters of its own"):
        s._setup_model(Own())


def test_built_ndim_is_the_shape_before_sharding():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    assert built_ndim(p) == 2
    p.data = torch.zeros(6)  # what FSDP leaves in a sharded parameter: a flat view of its shard
    p.built_ndim = 2  # recorded by RLHFFSDPStrategy before wrapping
    assert built_ndim(p) == 2 and p.ndim == 1
