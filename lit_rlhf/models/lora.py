"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on any trained model of lit_rlhf, through peft.

``W x`` becomes ``W x + (alpha / r) · B A x`` in the targeted linear layers, with ``A`` (r × in)
random, ``B`` (out × r) zero at the start and only ``A``, ``B`` (and heads) trained
(docs/scaling.md §2).

The adapters are injected into the model *in place* (``peft.inject_adapter_in_model``): the model
stays the transformers class it was (``generate``, ``base_model``, ``config`` and our value/reward
wrappers work unchanged), and this module provides what ``peft.PeftModel`` would:

* :func:`adapters_disabled` / :class:`AdaptersDisabled` — the model with its adapters off is the
  base model: the frozen reference of PPO, GRPO and DPO, with no second copy in memory;
* :func:`merged_state_dict` — ``W + (alpha / r) B A`` per layer, for a plain transformers export;
* :func:`save_adapter` — ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's format
  (``peft.PeftModel.from_pretrained(base, folder)`` loads it; so does ``model.name_or_path`` /
  ``algo.policy_path`` here, merged on load).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lit_rlhf.models.spec import LoraSpec
from lit_rlhf.utils.config import ConfigError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _targets(spec: LoraSpec) -> Any:
    return "all-linear" if list(spec.target_modules) == ["all-linear"] else list(spec.target_modules)


def peft_config(spec: LoraSpec, base_path: str | None = None) -> Any:
    """peft's ``LoraConfig`` of ``spec``; a value peft refuses is a ConfigError naming ``model.lora``."""
    from peft import LoraConfig

    try:
        return LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=_targets(spec),
            bias="none",
            base_model_name_or_path=base_path,
        )
    except (TypeError, ValueError) as err:
        raise ConfigError("model.lora", f"peft: {_one_line(err)}") from None


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def add_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Inject adapters into ``model`` in place and freeze everything else in it; returns ``model``.

    Raises:
        ConfigError: naming ``model.lora.target_modules`` when peft cannot adapt what it names (no
            such module, or one that is not a layer peft adapts), or when it names a layer other
            than a plain linear one (the adapter and merged exports handle those only).
    """
    from peft import inject_adapter_in_model
    from transformers.pytorch_utils import Conv1D

    key, config = "model.lora.target_modules", peft_config(spec)
    # GPT-2's projections are transformers' Conv1D, a linear layer storing its weight as (in, out):
    # peft adapts it with fan_in_fan_out (set here rather than by peft's warning, per layer either way)
    config.fan_in_fan_out = any(isinstance(m, Conv1D) for m in model.modules())
    try:
        inject_adapter_in_model(config, model)
    except (TypeError, ValueError) as err:  # peft's NoMatchingPeftModuleError is a ValueError
        where = f"{type(model).__name__}, {list(spec.target_modules)}"
        raise ConfigError(key, f"peft: {_one_line(err)} ({where})") from None
    layers = lora_layers(model)
    if not layers:
        raise ConfigError(key, f"{list(spec.target_modules)} matched no layer of {type(model).__name__}")
    _check_linear(layers, key)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        if ".lora_" in name and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()  # adapters train in fp32 on a bf16 base (peft's autocast_adapter_dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA r=%d alpha=%g on %d layers of %s: %d trainable parameters of %d (%.2f%%)",
        spec.r,
        spec.alpha,
        len(layers),
        type(model).__name__,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return model


def _check_linear(layers: dict[str, nn.Module], key: str) -> None:
    """Every adapted layer a linear one, ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2; its weight
    is (in, out), peft's fan_in_fan_out): what :func:`merged_state_dict` and :func:`adapter_state_dict`
    handle (an embedding would only fail at the export, after training)."""
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    for name, layer in layers.items():
        base = getattr(layer, "base_layer", layer)
        linear = isinstance(base, nn.Linear) and not getattr(layer, "fan_in_fan_out", False)
        conv1d = isinstance(base, Conv1D) and getattr(layer, "fan_in_fan_out", False)
        if not isinstance(layer, LoraLinear) or not (linear or conv1d):
            raise ConfigError(
                key,
                f"{name} is a {type(base).__name__}: only linear layers (nn.Linear, transformers' Conv1D) can be "
                "adapted (the exports handle no other)",
            )


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → peft LoRA layer, for every adapted layer of ``model``. Without peft imported
    no model has one: a run without LoRA does not import it (~12 MB and a third of a second)."""
    if "peft.tuners.lora" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every adapter off (the base model), as ``PeftModel.disable_adapter`` does."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersDisabled:
    """A frozen reference that is the trained model with its adapters off: calls run in eval
    mode (no dropout), without gradients, and restore every submodule's mode afterwards.
    Lives in a module's ``frozen`` dict (not a submodule: nothing is saved or optimized twice)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

        @functools.wraps(model.forward)  # same signature (callers inspect it, e.g. for logits_to_keep)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        self.forward = forward

    def __reduce__(self) -> Any:  # its forward is a closure: rebuilt around the model (the async producer)
        return AdaptersDisabled, (self.model,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad(), adapters_disabled(self.model):
                return self.model(*args, **kwargs)
        finally:
            for m, mode in modes:
                m.training = mode

    # the interface the stages use on a frozen model
    def to(self, *args: Any, **kwargs: Any) -> AdaptersDisabled:
        return self

    def eval(self) -> AdaptersDisabled:
        return self

    def train(self, mode: bool = True) -> AdaptersDisabled:
        return self  # calls always run in eval mode

    @property
    def training(self) -> bool:
        return False

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(())

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of the plain model: for each LoRA layer ``P``, ``P.weight = W + (alpha/r) B A``
    (transposed for a Conv1D's (in, out) weight; from ``state_dict``'s values when given, e.g. the
    best checkpoint's) and no adapter keys."""
    from peft.tuners.lora import Linear as LoraLinear

    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for name, layer in lora_layers(model).items():
        if not isinstance(layer, LoraLinear) or any(layer.use_dora.values()):
            raise NotImplementedError(
                f"merging {name} ({type(layer).__name__}) is not supported: only plain LoRA on linear layers"
            )
        (adapter,) = layer.active_adapters
        w = sd.pop(f"{name}.base_layer.weight")
        a, b = sd.pop(f"{name}.lora_A.{adapter}.weight"), sd.pop(f"{name}.lora_B.{adapter}.weight")
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
        if layer.fan_in_fan_out:
            delta = delta.T
        sd[f"{name}.weight"] = (w.float() + delta).to(w.dtype)
        if f"{name}.base_layer.bias" in sd:
            sd[f"{name}.bias"] = sd.pop(f"{name}.base_layer.bias")
    leftover = [k for k in sd if ".lora_" in k or ".base_layer." in k]
    if leftover:
        raise ValueError(f"adapter weights of unknown layers: {leftover[:3]}")
    return sd


def adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (``base_model.model.<layer>.lora_A.weight``)."""
    sd = model.state_dict() if state_dict is None else state_dict
    out = {}
    for name, layer in lora_layers(model).items():
        (adapter,) = layer.active_adapters
        for part in ("lora_A", "lora_B"):
            out[f"base_model.model.{name}.{part}.weight"] = sd[f"{name}.{part}.{adapter}.weight"]
    return out


def save_adapter(
    model: nn.Module, spec: LoraSpec, base_path: str, directory: str, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (peft's format) into ``directory``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model, state_dict).items()}
    save_file(weights, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(spec, base_path).to_dict()
    config["target_modules"] = sorted({name.rsplit(".", 1)[-1] for name in lora_layers(model)})
    config["fan_in_fan_out"] = any(layer.fan_in_fan_out for layer in lora_layers(model).values())
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as fh:
        json.dump(config, fh, indent=2, default=list)


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def adapter_base_path(path: str) -> str:
    with open(os.path.join(path, ADAPTER_CONFIG)) as fh:
        base = json.load(fh).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return base


def merge_adapter_into(model: nn.Module, path: str) -> nn.Module:
    """Load the adapter folder ``path`` onto ``model`` (its base) and merge it: a plain model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, path).merge_and_unload()
