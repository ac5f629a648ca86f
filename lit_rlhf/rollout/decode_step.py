"""One decoding step through a causal LM's decoder layers (:class:`_LayerStep`), used by the
decoding loop of :mod:`lit_rlhf.rollout.generate` for models whose 4-D decode masks are prebuilt:
the layers called directly, Llama-layout layers inlined op for op, checked once per model against
the model's own forward (docs/architecture.md "Padding-free forwards", decoding)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)


# Decoder layers whose ``forward`` is transformers' Llama layout, op for op (Mistral and Qwen2 are
# generated from Llama's; their attention only adds a ``sliding_window`` argument, unused without one).
_INLINE_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
_INLINE_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _rms_norm(norm: Any, hidden: Tensor) -> Tensor:
    """``LlamaRMSNorm.forward``, op for op (the same roundings)."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(module: Any, x: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, module.weight, module.bias)


def _inlinable(layer: Any) -> bool:
    """Whether one decoding step of ``layer`` may run as :func:`_inline_layer`: a known Llama-layout
    layer built of plain ``nn.Linear`` projections and its own RMSNorms, with no forward hooks
    anywhere (a hook, a peft LoRA wrapper, a ZeRO-3 gather, a quantized linear or an FSDP unit
    needs the modules' own calls: the layer's ``forward`` is used for it)."""
    from torch.nn.modules import module as torch_module

    if type(layer).__name__ not in _INLINE_LAYERS:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    try:
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
    except AttributeError:
        return False
    if not all(type(m) is torch.nn.Linear for m in linears) or not all(type(n).__name__ in _INLINE_NORMS for n in norms):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


def _inline_layer(layer: Any, cache_layer: Any, hidden: Tensor, mask: Tensor, cos: Tensor, sin: Tensor,
                  attention: Any) -> Tensor:  # fmt: skip
    """One decoding step of a Llama-layout decoder layer (``LlamaDecoderLayer.forward`` with its
    attention, rotary, RMSNorm and MLP, op for op, hence bit for bit), without the module calls,
    decorators and keyword plumbing around every op. ``cos``/``sin`` are (B, 1, 1, head dim)."""
    attn, mlp = layer.self_attn, layer.mlp
    residual = hidden
    x = _rms_norm(layer.input_layernorm, hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = _linear(attn.q_proj, x).view(shape).transpose(1, 2)
    k = _linear(attn.k_proj, x).view(shape).transpose(1, 2)
    v = _linear(attn.v_proj, x).view(shape).transpose(1, 2)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    k, v = cache_layer.update(k, v)
    out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
    hidden = residual + _linear(attn.o_proj, out.reshape(*x.shape[:-1], -1).contiguous())
    residual = hidden
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    return residual + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


class _LayerStep:
    """One decoding forward that calls the model's decoder layers directly: the embedding, each
    layer, the final norm and the LM head at the new token, with the prebuilt 4-D mask and the
    rotary ``(cos, sin)`` looked up in a table built once per rollout. It skips what the
    model-level ``forward`` redoes at every token (argument wrappers, mask and cache plumbing,
    the rotary computation). Layers of the Llama layout with plain modules (:func:`_inlinable`)
    run inlined (:func:`_inline_layer`: the same ops without the module calls around each);
    others run their own ``forward``. Sampling ``make bench``'s model (16 rows, 64 tokens) took
    14% less time than through the model's forward, 9% of it from the inlining (in-process A/B,
    the same tokens). Only for the standard decoder layout
    (``model.model`` with ``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``; an LM head;
    plain rotary) where the decode masks are prebuilt, and only after :func:`_layer_step_ok`
    found its logits equal to the model's own on the model's first decoding step. Callable like
    the model for one step.
    """

    def __init__(self, model: Any, max_positions: int) -> None:
        import sys

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = model.model
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.get_output_embeddings()
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        probe = inner.embed_tokens.weight[:1, None]  # dtype and device of the hidden states
        cos, sin = inner.rotary_emb(probe, torch.arange(max_positions, device=probe.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (positions, head dim)
        self.inline = [_inlinable(layer) for layer in self.layers]
        self.attention = None
        if any(self.inline):  # the interface the layers' attention looks up, with its module's eager fallback
            first = self.layers[self.inline.index(True)].self_attn
            eager = getattr(sys.modules[type(first).__module__], "eager_attention_forward", None)
            self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, eager)

    @staticmethod
    def supported(model: Any) -> bool:
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "rotary_emb", "layers", "norm")
        if inner is None or not all(hasattr(inner, a) for a in parts) or getattr(model, "get_output_embeddings", None) is None:
            return False
        return getattr(inner.rotary_emb, "rope_type", "default") == "default" and model.get_output_embeddings() is not None

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: Any, **_: Any) -> Any:
        from types import SimpleNamespace

        hidden = self.embed(input_ids)
        rotary = (self.cos[position_ids], self.sin[position_ids])
        cos, sin = rotary[0].unsqueeze(1), rotary[1].unsqueeze(1)
        for layer, inline in zip(self.layers, self.inline):
            if inline:
                hidden = _inline_layer(layer, cache.layers[layer.self_attn.layer_idx], hidden, attention_mask, cos, sin,
                                       self.attention)  # fmt: skip
            else:
                hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               use_cache=True, position_embeddings=rotary)  # fmt: skip
        return SimpleNamespace(logits=self.head(self.norm(hidden[:, -1:])), cache=cache)


_LAYER_STEP_VERDICTS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _layer_step_ok(model: Any, step: _LayerStep, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Whether ``step`` decodes ``model`` as its own forward does, decided once per model on its
    first decoding step: both run the same step (the layer step first, its cache entries then
    overwritten by the model's), logits compared at 1e-4 (fp32) / 2e-2 (half) of their scale.
    Returns the verdict and the model's own output for this step."""
    cache = kwargs["cache"]
    lengths = [layer.length for layer in cache.layers]
    mine = step(**kwargs).logits[:, -1]
    for layer, n in zip(cache.layers, lengths):  # rewind: the model's forward writes the same slots
        layer.length = n
    out = model(**kwargs)
    theirs = out.logits[:, -1]
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, float(theirs.abs().max()))
    gap = float((mine.float() - theirs.float()).abs().max())
    verdict = _LAYER_STEP_VERDICTS[model] = gap <= tol
    if verdict:
        log.info("layer-level decoding of %s matches its forward (max |Δ| %.1e)", type(model).__name__, gap)
    else:
        log.warning("layer-level decoding of %s differs from its forward by %.3g; decoding with its forward",
                    type(model).__name__, gap)  # fmt: skip
    return verdict, out
