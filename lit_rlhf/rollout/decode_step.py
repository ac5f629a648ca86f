"""One decoding step through a causal LM's decoder layers (:class:`LayerStep`), used by the
decoding loop of :mod:`lit_rlhf.rollout.generate` for models whose 4-D decode masks are prebuilt:
the layers called directly, Llama-layout layers inlined op for op (or, fp32 on CPU, with
oneDNN-prepacked projections), checked once per model against the model's own forward
(docs/architecture.md "Padding-free forwards", decoding)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.utils.compat.torch import (
    global_forward_hooks_active,
    has_forward_hooks,
    mkldnn_linear,
    mkldnn_linear_available,
    mkldnn_reorder_linear_weight,
)
from lit_rlhf.utils.compat.transformers import cache_keyword
from lit_rlhf.utils.facts import known, recall, remember

log = logging.getLogger(__name__)


# Decoder layers whose ``forward`` is transformers' Llama layout, op for op (Mistral and Qwen2 are
# generated from Llama's; their attention only adds a ``sliding_window`` argument, unused without one).
_INLINE_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
_INLINE_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _rms_norm(norm: Any, hidden: Tensor) -> Tensor:
    """``LlamaRMSNorm.forward`` with its roundings: in fp32 the fused ``F.rms_norm`` (one kernel,
    the same values bit for bit: tested), otherwise the layer's own ops in their order."""
    if hidden.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), norm.weight, norm.variance_epsilon)
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotary(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``) with the half
    rotation as one ``roll`` against a sine whose first half is negated: ``rotate_half(x) =
    cat(-x₂, x₁)`` and ``roll(x) = cat(x₂, x₁)``, so each product is the same float product up to
    an exact sign flip (bit for bit: tested), in 4 operators instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _projections(layer: Any) -> list:
    """A Llama-layout layer's seven projections: q, k, v, o, gate, up, down (AttributeError if it has others)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _linear(module: Any, x: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, module.weight, module.bias)


def prepack_supported(weight: Tensor) -> bool:
    """Whether oneDNN prepacked projections apply: an fp32 CPU weight, no CPU autocast (the
    ``bf16-mixed`` precision's products are autocast's, which passes prepacked operators by), and
    a torch built with the oneDNN linear operators (the x86-64 CPU wheels have them; elsewhere a
    failure falls back)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and mkldnn_linear_available()
    )


class _Packed:
    """A weight matrix (or several stacked along the output dimension) reordered ONCE into oneDNN's
    blocked layout for ``rows`` input rows: a decoding step multiplies 1 token per row by every
    projection, and a small-M product streams the whole weight from memory; from the blocked
    layout oneDNN reads it faster than a plain row-major matrix. Measured on the CI machine kind
    (16 rows x 256 inputs, 28 matrices that do not stay in cache): ~45 µs a product against
    ~65 µs; sampling ``make bench``'s model with these and the fused q/k/v and gate/up products:
    1.3-1.4x faster in-process. One copy of the weights, made per rollout (the weights change
    between rollouts) and freed with it."""

    def __init__(self, modules: list, rows: int) -> None:
        weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight
        biases = [m.bias for m in modules]
        if all(b is None for b in biases):
            self.bias = None
        else:
            self.bias = torch.cat(
                [b if b is not None else weight.new_zeros(m.weight.shape[0]) for m, b in zip(modules, biases)]
            )
        self.weight = mkldnn_reorder_linear_weight(weight.detach(), rows)

    def __call__(self, x: Tensor) -> Tensor:
        return mkldnn_linear(x, self.weight, self.bias)


class _PackedLayer:
    """One inlinable layer's projections, prepacked: q/k/v as one product, gate/up as one."""

    def __init__(self, layer: Any, rows: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Packed([attn.q_proj, attn.k_proj, attn.v_proj], rows)
        self.heads, self.kv_heads = (
            attn.q_proj.weight.shape[0] // attn.head_dim,
            attn.k_proj.weight.shape[0] // attn.head_dim,
        )
        self.o, self.gate_up, self.down = (
            _Packed([attn.o_proj], rows),
            _Packed([mlp.gate_proj, mlp.up_proj], rows),
            _Packed([mlp.down_proj], rows),
        )
        self.intermediate = mlp.gate_proj.weight.shape[0]


def _inlinable(layer: Any) -> bool:
    """Whether one decoding step of ``layer`` may run as :func:`_inline_layer`: a known Llama-layout
    layer built of plain ``nn.Linear`` projections and its own RMSNorms, with no forward hooks
    anywhere (a hook, a peft LoRA wrapper, a ZeRO-3 gather, a quantized linear or an FSDP unit
    needs the modules' own calls: the layer's ``forward`` is used for it)."""
    if type(layer).__name__ not in _INLINE_LAYERS:
        return False
    if global_forward_hooks_active():
        return False
    try:
        linears = _projections(layer)
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
    except AttributeError:
        return False
    if not all(type(m) is torch.nn.Linear for m in linears) or not all(
        type(n).__name__ in _INLINE_NORMS for n in norms
    ):
        return False
    return not any(has_forward_hooks(m) for m in layer.modules())


def _inline_layer(
    layer: Any,
    cache_layer: Any,
    hidden: Tensor,
    mask: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    attention: Any,
    packed: _PackedLayer | None = None,
) -> Tensor:
    """One decoding step of a Llama-layout decoder layer (``LlamaDecoderLayer.forward`` with its
    attention, rotary, RMSNorm and MLP), without the module calls, decorators and keyword plumbing
    around every op. ``hidden`` is (B, 1, hidden size); ``cos``/``sin_signed`` are (B, 1, 1, head
    dim) (:func:`_rotary`). Without ``packed`` the ops are the layer's own, in its order: bit for
    bit its forward. With ``packed`` (:class:`_PackedLayer`) the projections are oneDNN products
    of prepacked weights, q/k/v in one and gate/up in one: equal to the layer's forward up to
    float rounding (another summation order), which :func:`layer_step_ok` bounds."""
    attn, mlp = layer.self_attn, layer.mlp
    residual = hidden
    x = _rms_norm(layer.input_layernorm, hidden)
    b, d = x.shape[0], attn.head_dim
    if packed is None:
        shape = (b, 1, -1, d)
        q = _rotary(_linear(attn.q_proj, x).view(shape), cos, sin_signed).transpose(1, 2)
        k = _rotary(_linear(attn.k_proj, x).view(shape), cos, sin_signed).transpose(1, 2)
        v = _linear(attn.v_proj, x).view(shape).transpose(1, 2)
    else:
        qkv = packed.qkv(x).view(b, 1, -1, d)  # (B, 1, heads + 2·kv heads, D)
        qk = _rotary(qkv[:, :, : packed.heads + packed.kv_heads], cos, sin_signed)
        q, k = qk[:, :, : packed.heads].transpose(1, 2), qk[:, :, packed.heads :].transpose(1, 2)
        v = qkv[:, :, packed.heads + packed.kv_heads :].transpose(1, 2)
    k, v = cache_layer.update(k, v)
    out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
    out = out.reshape(b, 1, -1).contiguous()
    hidden = residual + (_linear(attn.o_proj, out) if packed is None else packed.o(out))
    residual = hidden
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    if packed is None:
        return residual + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
    gate, up = packed.gate_up(x).split(packed.intermediate, -1)
    return residual + packed.down(mlp.act_fn(gate) * up)


class LayerStep:
    """One decoding forward that calls the model's decoder layers directly: the embedding, each
    layer, the final norm and the LM head at the new token, with the prebuilt 4-D mask and the
    rotary ``(cos, sin)`` looked up in a table built once per rollout. It skips what the
    model-level ``forward`` redoes at every token (argument wrappers, mask and cache plumbing,
    the rotary computation). Layers of the Llama layout with plain modules (:func:`_inlinable`)
    run inlined (:func:`_inline_layer`: the same ops without the module calls around each, the
    RMSNorm fused and the rotary as one roll, bit for bit); others run their own ``forward``.
    With ``rows`` (the batch size) and fp32 weights on a CPU with oneDNN
    (:func:`prepack_supported`), the inlined layers' projections and the LM head multiply
    prepacked weights (:class:`_PackedLayer`: one copy of those weights for the rollout).
    Only for the standard decoder layout
    (``model.model`` with ``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``; an LM head;
    plain rotary) where the decode masks are prebuilt, and only after :func:`layer_step_ok`
    found its logits equal to the model's own on the model's first decoding step. Callable like
    the model for one step. ``make bench`` (``generate_*``) measures it against ``generate``.
    """

    def __init__(self, model: Any, max_positions: int, rows: int | None = None) -> None:
        import sys

        from lit_rlhf.utils.compat.transformers import attention_interface

        inner = model.model
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.get_output_embeddings()
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.cache_keyword = cache_keyword()  # the KV cache's keyword in the layers' forward
        probe = inner.embed_tokens.weight[:1, None]  # dtype and device of the hidden states
        cos, sin = inner.rotary_emb(probe, torch.arange(max_positions, device=probe.device)[None])
        half = cos.shape[-1] // 2
        self.cos, self.sin = cos[0], sin[0]  # (positions, head dim)
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], -1)  # see _rotary
        self.inline = [_inlinable(layer) for layer in self.layers]
        self.attention = None
        if any(self.inline):  # the interface the layers' attention looks up, with its module's eager fallback
            first = self.layers[self.inline.index(True)].self_attn
            eager = getattr(sys.modules[type(first).__module__], "eager_attention_forward", None)
            self.attention = attention_interface(model.config, eager)
        self.packed: list[_PackedLayer | None] = [None] * len(self.layers)
        self.packed_head: _Packed | None = None
        if (
            rows is not None
            and any(self.inline)
            and prepack_supported(self.embed.weight)
            and self._room_to_prepack(model)
        ):
            try:
                self.packed = [
                    _PackedLayer(layer, rows) if inline else None for layer, inline in zip(self.layers, self.inline)
                ]
                if type(self.head) is torch.nn.Linear and not has_forward_hooks(self.head):
                    self.packed_head = _Packed([self.head], rows)
            except RuntimeError as err:  # a oneDNN build without these kernels for this CPU: plain products
                log.warning("prepacking the decoding weights failed (%s); decoding with F.linear", err)
                self.packed, self.packed_head = [None] * len(self.layers), None

    @property
    def prepacked(self) -> bool:
        """Whether any projection multiplies a prepacked copy (rounds like oneDNN, not ``F.linear``)."""
        return self.packed_head is not None or any(p is not None for p in self.packed)

    def _room_to_prepack(self, model: Any) -> bool:
        """Whether the prepacked copy (every inlined projection and the head, fp32) takes at most
        half of the host memory available now; if not, decode with F.linear (warned once per model)."""
        linears = [m for layer, inline in zip(self.layers, self.inline) if inline for m in _projections(layer)]
        head = getattr(self.head, "weight", None)
        need = 4 * (sum(m.weight.numel() for m in linears) + (head.numel() if head is not None else 0))
        available = _available_memory()
        if available is None or need <= available // 2:
            return True
        if not known(model, "prepack_skip_told"):  # warned once per model
            remember(model, "prepack_skip_told", True)
            log.warning(
                "prepacking %s's decoding weights would take %.1f GiB of the %.1f GiB of memory available; "
                "decoding with F.linear (algo.generation.prepack=false silences this)",
                type(model).__name__,
                need / 2**30,
                available / 2**30,
            )
        return False

    @staticmethod
    def supported(model: Any) -> bool:
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "rotary_emb", "layers", "norm")
        if (
            inner is None
            or not all(hasattr(inner, a) for a in parts)
            or getattr(model, "get_output_embeddings", None) is None
        ):
            return False
        return (
            getattr(inner.rotary_emb, "rope_type", "default") == "default" and model.get_output_embeddings() is not None
        )

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        cache = kwargs[self.cache_keyword]

        hidden = self.embed(input_ids)
        cos = self.cos[position_ids]  # (B, 1, head dim)
        rotary_cos, rotary_sin = cos.unsqueeze(1), self.sin_signed[position_ids].unsqueeze(1)
        own = None if all(self.inline) else (cos, self.sin[position_ids])  # for layers that run their forward
        for layer, inline, packed in zip(self.layers, self.inline, self.packed):
            if inline:
                hidden = _inline_layer(
                    layer,
                    cache.layers[layer.self_attn.layer_idx],
                    hidden,
                    attention_mask,
                    rotary_cos,
                    rotary_sin,
                    self.attention,
                    packed,
                )
            else:
                hidden = layer(
                    hidden,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=True,
                    position_embeddings=own,
                    **{self.cache_keyword: cache},
                )
        last = self.norm(hidden[:, -1:])
        return SimpleNamespace(
            logits=self.head(last) if self.packed_head is None else self.packed_head(last), cache=cache
        )


def _verdicts(model: Any) -> dict[tuple, bool]:
    """``model``'s {(prepacked, autocast dtype): verdict}, kept on the model (lit_rlhf/utils/facts.py):
    the prepacked and the exact step round differently, and so does each under autocast (a
    ``bf16-mixed`` run samples under it, an evaluation after it may not): each is judged on its own."""
    return recall(model, "layer_step_verdicts", dict)


def _judged(model: Any, prepacked: bool) -> tuple:
    """The key of the verdict that applies now: the step, and the autocast on the model's device."""
    kind = next((p.device.type for p in model.parameters()), "cpu")
    return prepacked, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def layer_step_verdict(model: Any, prepacked: bool) -> bool | None:
    """Whether the layer-level step (prepacked or exact) decodes ``model`` as its forward does, under
    the autocast in force now: True / False once judged (:func:`layer_step_ok`, on the model's first
    decoding step in that context), None before."""
    return (known(model, "layer_step_verdicts") or {}).get(_judged(model, prepacked))


def _available_memory() -> int | None:
    """Bytes of host memory available now (psutil, a dependency of DeepSpeed), None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil, or no reading on this platform: no cap
        return None


def layer_step_ok(model: Any, step: LayerStep, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Whether ``step`` decodes ``model`` as its own forward does, decided once per model (and per
    prepacked / exact step, and autocast) on its first decoding step: both run the same step (the
    layer step first, its cache entries then overwritten by the model's), logits compared at 1e-4
    (fp32) / 2e-2 (half, or under a half autocast) of their scale. Returns the verdict and the
    model's own output for this step."""
    cache = kwargs[step.cache_keyword]
    lengths = [layer.length for layer in cache.layers]
    failure = None
    try:
        mine = step(**kwargs).logits[:, -1]
    except RuntimeError as err:  # e.g. a kernel this build lacks: the model's forward works regardless
        failure = err
    finally:
        for layer, n in zip(cache.layers, lengths):  # rewind: the model's forward writes the same slots
            layer.length = n
    out = model(**kwargs)
    theirs = out.logits[:, -1]
    if failure is not None:
        _verdicts(model)[_judged(model, step.prepacked)] = False
        log.warning("layer-level decoding of %s failed (%s); decoding with its forward", type(model).__name__, failure)
        return False, out
    dtype = _judged(model, step.prepacked)[1] or next((p.dtype for p in model.parameters()), torch.float32)
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, float(theirs.abs().max()))  # autocast's, or the weights
    gap = float((mine.float() - theirs.float()).abs().max())
    verdict = _verdicts(model)[_judged(model, step.prepacked)] = gap <= tol
    if verdict:
        log.info("layer-level decoding of %s matches its forward (max |Δ| %.1e)", type(model).__name__, gap)
    else:
        log.warning(
            "layer-level decoding of %s differs from its forward by %.3g; decoding with its forward",
            type(model).__name__,
            gap,
        )
    return verdict, out
