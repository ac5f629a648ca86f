"""lit_rlhf/runtime/strategies.py without processes: the FSDP strategy's refusals, the gradient norm
every non-DeepSpeed update checks and clips with (against torch's own), and the shape rule the
optimizer groups read. The strategies'
real runs (FSDP, ZeRO-2/3 on 2 CPU processes) are in tests/test_distributed.py."""

import pytest
import torch

from lit_rlhf.runtime.strategies import RLHFFSDPStrategy, built_ndim, sharded_grad_norm

LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _params_with_grads(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((16, 8), (8,), (5, 3, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: ignored
    return params


class _Unsharded:
    shards_gradients = False
    root_device = torch.device("cpu")


@pytest.mark.parametrize("scale, max_norm", [(1.0, 0.5), (1.0, 100.0), (1e-3, 1.0)])
def test_norm_then_clip_is_torch_clip_grad_norm_exactly(scale, max_norm):
    """Unsharded (gradients already whole): the norm the update checks and clips with is
    torch's, bit for bit, so DDP/single-device runs clip exactly as ``clip_grad_norm_`` does."""
    ours, theirs = _params_with_grads(0, scale), _params_with_grads(0, scale)
    norm = sharded_grad_norm(ours, _Unsharded())
    torch.nn.utils.clip_grads_with_norm_(ours, max_norm, norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected) and float(norm) == pytest.approx(
        sum(float(p.grad.double().pow(2).sum()) for p in _params_with_grads(0, scale)[:3]) ** 0.5, rel=1e-6
    )
    for a, b in zip(ours[:3], theirs[:3]):
        assert torch.equal(a.grad, b.grad)
    assert ours[3].grad is None
    assert float(sharded_grad_norm([torch.nn.Parameter(torch.zeros(2))], _Unsharded())) == 0.0  # no gradients


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_gradient_element_makes_the_norm_non_finite(bad):
    """The update's finite check reads the norm: one NaN/inf among many elements must show."""
    params = _params_with_grads(1, 1.0)
    assert bool(torch.isfinite(sharded_grad_norm(params, _Unsharded())))
    params[2].grad[4, 1, 0] = bad
    assert not bool(torch.isfinite(sharded_grad_norm(params, _Unsharded())))


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

    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_rlhf.models.lora import add_lora
    from lit_rlhf.models.spec import LoraSpec

    class WithLora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = LlamaConfig(
                vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            )
            self.actor = add_lora(LlamaForCausalLM(cfg), LoraSpec(enabled=True, r=2))

    with pytest.raises(ValueError, match=r"\['actor'\] carry LoRA adapters"):
        s._setup_model(WithLora())


def test_built_ndim_is_the_shape_before_sharding():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    assert built_ndim(p) == 2
    p.data = torch.zeros(6)  # what FSDP leaves in a sharded parameter: a flat view of its shard
    p.built_ndim = 2  # recorded by RLHFFSDPStrategy before wrapping
    assert built_ndim(p) == 2 and p.ndim == 1
