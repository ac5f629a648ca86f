"""``RLHFModule``: what every stage shares: late model building, optimizer/schedule, logging, export."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lit_rlhf.models.lora import has_lora, merged_state_dict
from lit_rlhf.models.spec import ModelSpec, check_model_path
from lit_rlhf.modules.configs import OptimConfig
from lit_rlhf.utils.config import resolve_config, to_dict

log = logging.getLogger(__name__)
_EXPORTED = object()  # _export_lora wrote the export itself


class RLHFModule(pl.LightningModule):
    """Base LightningModule: receives a validated config and ``ModelSpec``s, never weights.

    Subclasses set ``config_class`` and build their networks in ``configure_model()``, which
    Lightning calls under the strategy's init context (sharded init for DeepSpeed/FSDP) and
    which must stay idempotent. Hyper-parameters saved in checkpoints are the two small dicts
    (config, model spec), so ``load_from_checkpoint`` rebuilds the module from them.

    What the runner asks of every stage (lit_rlhf/launch/runner.py; docs/architecture.md "Interfaces"):

    * ``config_class`` — the dataclass of its ``algo.*`` keys;
    * ``data_kind`` — the section of the ``data`` group it reads (``data.sft``, ``data.prompt`` …);
    * ``monitor`` — (metric, mode) that ``callbacks.model_checkpoint.monitor=auto`` selects;
    * :meth:`resolve_model_spec`, :meth:`resolve_data_config`, :meth:`check_compatible` —
      cross-group rules applied before anything is built (defaults: no change, no check);
    * :meth:`check_paths` (``model_path_keys``) — the model folders the config names exist;
    * :meth:`planned_models` — every model a run of the stage holds, for the memory plan.
    """

    config_class: type = OptimConfig
    data_kind: str = "sft"
    monitor: tuple[str | None, str] = (None, "min")

    @classmethod
    def resolve_model_spec(cls, config: Any, spec: ModelSpec) -> ModelSpec:
        """The model to build, given the ``model`` group's spec (e.g. PPO trains ``algo.policy_path``)."""
        return spec

    @classmethod
    def resolve_data_config(cls, config: Any, data: Any) -> Any:
        """The data config to build, given the stage's config (e.g. the rollout batch size)."""
        return data

    @classmethod
    def check_compatible(cls, config: Any, spec: ModelSpec) -> None:
        """Raise ``ConfigError`` when the stage's config and the model cannot work together."""

    @classmethod
    def planned_models(cls, config: Any) -> list[tuple[str, str, str | None]]:
        """(name, role, path or None = the model group's) of every model a run holds, for the
        memory plan (lit_rlhf/launch/memory_plan.py). Roles: "trained", "frozen", "frozen-ref" (a frozen
        copy of the trained model: under LoRA, the same weights with the adapters off)."""
        return [("policy", "trained", None)]

    model_path_keys: tuple[str, ...] = ()
    """``algo.*`` keys naming model folders, checked by :meth:`check_paths` (policy, reward …)."""

    @classmethod
    def check_paths(cls, config: Any) -> None:
        """Before anything is loaded (runner.build): every local model folder the config names
        exists and is an export, or a ConfigError names the key that points elsewhere."""
        for name in cls.model_path_keys:
            value = getattr(config, name)
            if value:
                check_model_path(value, f"algo.{name}")

    def __init__(
        self,
        config: Any = None,
        model: ModelSpec | Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.config = resolve_config(self.config_class, config, kwargs, "algo")
        self.model_spec = resolve_config(ModelSpec, model, {}, "model") if model is not None else None
        self.tokenizer = tokenizer
        self.engine: Any = None  # the vllm rollout engine (algo.generation.engine=vllm), built at the first rollout
        self._weight_loads = 0  # weights replaced other than by an optimizer step (a rollback, a restore)
        self.save_hyperparameters(
            {"config": to_dict(self.config), "model": to_dict(self.model_spec) if self.model_spec else None}
        )

    # ------------------------------------------------------------------ helpers
    def ensure_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from lit_rlhf.data.tokenizers import build_tokenizer

            if self.model_spec is None:
                raise ValueError("the module has neither a tokenizer nor a model spec to build one")
            self.tokenizer = build_tokenizer(self.model_spec)
        return self.tokenizer

    def log_stats(self, prefix: str, stats: Mapping[str, Any], **kwargs: Any) -> None:
        """Log ``{prefix}/{name}`` for every stat (namespaced names, docs/metrics.md)."""
        self.log_dict({f"{prefix}/{k}": v for k, v in stats.items()}, **kwargs)

    # ------------------------------------------------------- optimizer/schedule
    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        c: OptimConfig = self.config
        if c.optimizer == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
        groups = list(params)
        return torch.optim.AdamW(
            groups,
            lr=c.lr,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
            fused=self._fused_adamw_ok(groups) or None,
        )

    def _fused_adamw_ok(self, groups: list[Any]) -> bool:
        """torch's fused AdamW kernel (one call for all parameters instead of a Python loop over
        them; what transformers' Trainer uses): for plain floating parameters on CPU/CUDA outside
        DeepSpeed and FSDP, which hold and step their parameters their own way."""
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and (
            isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
        ):
            return False
        params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        return bool(params) and all(
            type(p) is torch.nn.Parameter
            and p.device.type in ("cpu", "cuda")
            and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
            for p in params
        )

    def decay_groups(self, model: torch.nn.Module, **extra: Any) -> list[dict[str, Any]]:
        """``model``'s trainable parameters as two optimizer groups: matrices with
        ``algo.weight_decay``, vectors (norm weights, biases) without; ``extra`` keys (e.g. ``lr``)
        in both. Judged on the shape as built, which FSDP's flat shards hide (strategies.built_ndim)."""
        from lit_rlhf.runtime.strategies import built_ndim

        params = [p for p in model.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if built_ndim(p) >= 2], "weight_decay": self.config.weight_decay, **extra},
            {"params": [p for p in params if built_ndim(p) < 2], "weight_decay": 0.0, **extra},
        ]

    def configure_optimizers(self) -> Any:
        """AdamW over :meth:`exportable_model`'s trainable parameters (no decay on norms/biases)
        and a per-step warm-up + decay schedule."""
        optimizer = self.build_optimizer(self.decay_groups(self.exportable_model()))
        return {"optimizer": optimizer, "lr_scheduler": self.build_scheduler(optimizer, self.total_optimizer_steps())}

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """``trainer.gradient_clip_val`` (automatic optimization): Lightning's, except norm clipping
        under FSDP, which Lightning refuses: lit_rlhf clips by the norm across shards there."""
        from lit_rlhf.runtime.strategies import RLHFFSDPStrategy

        strategy = self.trainer.strategy
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and isinstance(strategy, RLHFFSDPStrategy):
            from lit_rlhf.runtime.strategies import sharded_grad_norm

            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, float(gradient_clip_val), sharded_grad_norm(params, strategy))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of the base lr at optimizer step ``step`` of ``total_steps``."""
        c: OptimConfig = self.config
        warmup = c.warmup_steps or int(round(c.warmup_ratio * total_steps))
        if step < warmup:
            return (step + 1) / warmup
        if c.scheduler == "constant":
            return 1.0
        if c.scheduler == "inverse_sqrt":  # transformers' get_inverse_sqrt_schedule (timescale = warm-up or 10,000)
            timescale = warmup or 10_000
            return math.sqrt(timescale / (step - warmup + timescale))
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 1.0 - progress if c.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return c.min_lr_ratio + (1.0 - c.min_lr_ratio) * shape

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> dict[str, Any]:
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.lr_factor(s, total_steps))
        return {"scheduler": sched, "interval": "step", "frequency": 1}

    def total_optimizer_steps(self) -> int:
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the lr schedule needs a length")
        return max(1, int(steps))

    # ------------------------------------------------------------------ export
    def on_fit_end(self) -> None:
        """Export the trained model to ``algo.export_dir`` (when set) at the end of every fit."""
        if self.config.export_dir:
            self.export(self.config.export_dir)

    def exportable_model(self) -> torch.nn.Module:
        """The Hugging Face model that :meth:`export` saves."""
        raise NotImplementedError

    def export(self, directory: str, state_dict: dict[str, Any] | None = None) -> None:
        """``save_pretrained`` the model and tokenizer into ``directory``, atomically.

        Every rank must call it (sharded strategies gather the state collectively); rank zero
        writes into a temporary sibling folder and renames it into place, so a crash never
        leaves a half-written model where a later stage would load it. ``state_dict``: the
        LightningModule-level weights to write instead of the live ones (e.g. the best
        checkpoint's; only rank zero's is used; every rank must agree on passing one).
        """
        model = self.exportable_model()
        trainer = self._trainer
        state = state_dict
        if state is None and trainer is not None:
            state = trainer.strategy.lightning_module_state_dict()
        if trainer is None or trainer.is_global_zero:
            from lit_rlhf.modules.health import check_finite_state

            prefix = self._state_prefix(model)
            sd = None
            if state is not None:
                sd = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            check_finite_state(sd if sd is not None else model.state_dict(), f"the model to {directory}")
            if has_lora(model):
                sd = self._export_lora(model, sd, directory)
            if sd is not _EXPORTED:
                save_pretrained_atomic(model, self.ensure_tokenizer(), directory, state_dict=sd)
            log.info("exported %s to %s", type(model).__name__, directory)
        if trainer is not None:
            trainer.strategy.barrier("export")

    def weights_are_whole(self) -> bool:
        """Whether every rank holds the trained models' whole weights: no trainer, one device, DDP,
        DeepSpeed ZeRO-1/2. False under ZeRO-3 and FSDP (shards; gathered by :meth:`sampling_mode`)
        and under any other strategy."""
        if self._trainer is None:
            return True
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            return not strategy.zero_stage_3
        return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))

    def sampling_mode(self, model: torch.nn.Module) -> Any:
        """The context for sampling from ``model`` (and the frozen models' scoring forwards); under
        ZeRO-3 and FSDP it gathers every trained model of the module, ``model`` or not:

        * ``torch.inference_mode()`` where every rank holds whole weights (one device, DDP, ZeRO-1/2):
          no autograd bookkeeping at all, faster decoding than ``no_grad``;
        * DeepSpeed ZeRO-3: ``no_grad`` with the trained models' partitions gathered ONCE for the
          whole context and the engine's per-module fetch/release hooks removed meanwhile
          (:func:`lit_rlhf.runtime.strategies.zero3_gathered`; docs/scaling.md §4), instead of
          gathering layer by layer at every decoding step; partitioned again on exit;
        * FSDP (:class:`lit_rlhf.runtime.strategies.RLHFFSDPStrategy`): ``no_grad`` with every unit's
          weights gathered once for the context (:func:`lit_rlhf.runtime.strategies.fsdp_gathered`);
        * any other strategy: ``no_grad``.
        """
        if self.weights_are_whole():
            return torch.inference_mode()
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):  # ZeRO-3
            engine = getattr(strategy, "model", None)  # None before setup: nothing partitioned yet
            if not hasattr(engine, "module"):
                return torch.no_grad()
            from lit_rlhf.runtime.strategies import zero3_gathered

            return zero3_gathered(engine)
        from lit_rlhf.runtime.strategies import RLHFFSDPStrategy, fsdp_gathered

        if isinstance(strategy, RLHFFSDPStrategy) and strategy.wrapped:  # before setup: nothing sharded yet
            return fsdp_gathered(self)
        return torch.no_grad()

    # ------------------------------------------------------------ rollout engine
    def rollout_engine(self, model: torch.nn.Module) -> Any:
        """Who samples from ``model``: None = the hf decoding loop over ``model`` itself; with
        ``algo.generation.engine=vllm`` this module's vLLM engine (lit_rlhf/rollout/vllm_engine.py),
        built at the first call, released in :meth:`teardown`, and its weights synced to
        ``model``'s whenever they changed since its last sync (an optimizer step, a rollback, a
        checkpoint restore). Call it inside
        :meth:`sampling_mode`: under ZeRO-3/FSDP that is where the weights are whole."""
        gen = getattr(self.config, "generation", None)
        if gen is None or gen.engine == "hf":
            return None
        from lit_rlhf.rollout.vllm_engine import engine_for

        self.engine = engine_for(model, gen, self.weights_version(), self.engine, self.vllm_logprobs_mode())
        return self.engine

    def vllm_logprobs_mode(self) -> str:
        """The log-probs a vLLM engine returns: of the raw logits, or of the tempered ones when the
        trainer's are (``algo.logprobs_at_sampling_temperature``)."""
        gen = self.config.generation
        at_temperature = getattr(self.config, "logprobs_at_sampling_temperature", False) and gen.temperature != 1.0
        return "processed_logprobs" if at_temperature else "raw_logprobs"

    def weights_version(self) -> tuple[int, int]:
        """Changes when the trained weights do: (optimizer steps, loads of a state dict)."""
        return (self._trainer.global_step if self._trainer is not None else 0, self._weight_loads)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._weight_loads += 1  # the rollout engine re-syncs (rollout_engine)
        return super().load_state_dict(*args, **kwargs)

    def engine_sleep(self) -> None:
        """Free the vllm engine's GPU memory until the next rollout (``algo.generation.vllm.sleep``)."""
        if self.engine is not None:
            self.engine.sleep()

    def teardown(self, stage: str) -> None:
        """The end of a fit (or validate/test): the vllm engine is released; a later rollout builds anew.
        Also when the fit fails (:class:`TeardownOnFailure`): what it holds, processes included, is
        released before the error reaches the caller."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()

    def configure_callbacks(self) -> list[pl.Callback]:
        return [TeardownOnFailure()]

    def with_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with LoRA adapters injected when ``model.lora.enabled`` (then only they, and
        heads outside ``model``, train: lit_rlhf/models/lora.py); else ``model`` unchanged."""
        if self.model_spec is not None and self.model_spec.lora.enabled:
            from lit_rlhf.models.lora import add_lora

            add_lora(model, self.model_spec.lora)
        return model

    def reference_for(self, policy: torch.nn.Module, build: Any) -> Any:
        """The frozen reference of ``policy``: the policy itself with its adapters disabled when it
        trains LoRA adapters (the base weights, no second copy in memory), else ``build()``."""
        from lit_rlhf.models.lora import AdaptersDisabled

        return AdaptersDisabled(policy) if has_lora(policy) else build()

    def _export_lora(self, model: torch.nn.Module, sd: dict[str, Any] | None, directory: str) -> Any:
        """A LoRA-trained model's export (docs/scaling.md §2): the adapter in peft's format
        when ``model.lora.export=adapter`` and the base model has a path to name (writes it and
        returns ``_EXPORTED``), else the merged weights to save as a plain model."""
        from transformers import PreTrainedModel

        from lit_rlhf.models.builders import resolve_path
        from lit_rlhf.models.lora import save_adapter
        from lit_rlhf.utils.io import atomic_folder

        lora = self.model_spec.lora
        base = self.model_spec.name_or_path
        if lora.export == "adapter" and base is not None and isinstance(model, PreTrainedModel):
            base = resolve_path(base)
            base = os.path.abspath(base) if os.path.exists(base) else base

            def write(folder: str) -> None:
                save_adapter(model, lora, base, folder, sd)
                self.ensure_tokenizer().save_pretrained(folder)

            atomic_folder(directory, write)
            return _EXPORTED
        if lora.export == "adapter":
            log.warning(
                "model.lora.export=adapter: exporting merged weights instead, because %s",
                "the base model was built from a config (model.tiny) and has no path an adapter could name"
                if base is None
                else "a reward model is loaded whole (backbone and head)",
            )
        return merged_state_dict(model, sd)

    def _state_prefix(self, model: torch.nn.Module) -> str:
        for name, module in self.named_modules():
            if module is model:
                return f"{name}." if name else ""
        raise ValueError("the exported model is not a submodule of this LightningModule")


def policy_spec(policy_path: str | None, spec: ModelSpec) -> ModelSpec:
    """The model a preference / RL stage trains: ``policy_path`` (an SFT export) when set, else the
    ``model`` group's model, whose dtype and memory switches apply either way. An untrained tiny
    model (``model.tiny``) is refused: these stages start from a trained policy."""
    from lit_rlhf.utils.config import ConfigError

    if policy_path is not None:
        return spec.at_path(policy_path)
    if spec.tiny is not None:
        raise ConfigError(
            "algo.policy_path",
            "is required here: the model group builds an untrained tiny model "
            "(model.tiny), and this stage starts from a trained policy; set it to "
            "an SFT export, e.g. <run>/sft/policy of the demo",
        )
    return spec


def save_pretrained_atomic(model: Any, tokenizer: Any, directory: str, state_dict: dict | None = None) -> None:
    """Write ``model`` (+ tokenizer) to a temp folder next to ``directory``, then swap it in
    (:func:`lit_rlhf.utils.io.atomic_folder`)."""
    from lit_rlhf.utils.io import atomic_folder

    def write(folder: str) -> None:
        model.save_pretrained(folder, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    atomic_folder(directory, write)


class TeardownOnFailure(pl.Callback):
    """Lightning tears the module down (``LightningModule.teardown``) only at a fit's normal end; on
    an exception it calls the callbacks' ``on_exception`` instead. This one tears the module down
    there, so that a failed fit leaves no rollout producer, vLLM engine or tool worker behind, and
    a retry in the same process (``trainer.fit(module, ckpt_path="last")``) starts them afresh."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            pl_module.teardown(trainer.state.fn.value if trainer.state.fn is not None else "fit")
        except Exception:  # the fit's own error is the one to raise
            log.exception("tearing the module down after a failed fit failed too")
