"""The memory plan: per-GPU memory of a composed job before anything is loaded (docs/scaling.md).

``python train.py model=llama7b algo=ppo_max strategy=deepspeed_stage_2 trainer.devices=8 --plan``
prints, for every model of the stage (policy/actor, critic, reference, reward), its parameters
and the per-GPU bytes of weights, gradients and optimizer states under the configured strategy,
precision and LoRA setting, plus an activation estimate for the training micro-batch and the
KV cache of generation, and whether the sum fits ``memory_plan.gpu_memory_gb``. A GPU launch that
cannot fit is refused before any weight is loaded (``memory_plan.enforce``), with the switches
that would make it fit.

Model states follow DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``,
``estimate_zero3_model_states_mem_needs``; tests/launch/test_memory_plan.py compares them), bytes per
parameter ``P`` on ``N`` GPUs:

=====================  ===========================================================
DDP, bf16-mixed        16 P (fp32 weights 4, fp32 grads 4, Adam m and v 8)
FSDP full shard        16 P / N (+ one gathered layer)
ZeRO-2                 2 P + 18 P / N (bf16 weights; bf16 + fp32 grads, fp32 master, m, v sharded)
ZeRO-2, offload        2 P (optimizer on the CPU)
ZeRO-3                 18 P / N + 4 × largest layer
ZeRO-3, offload opt.   2 P / N + 4 × largest layer
=====================  ===========================================================

Frozen models (reference, reward model) are replicated at the weights dtype. Under LoRA the
trained models' base weights count as frozen, their adapters as trained, and the reference costs
nothing (it is the actor with its adapters off). Activations are the estimate of Korthikanti et
al. 2022 (arXiv:2205.05198) with fused attention: 34·s·b·h bytes per layer and micro-batch
(2·s·b·h with gradient checkpointing, plus one layer recomputed), plus fp32 logits and their
gradient (8·s·b·V). Under ZeRO-3 and FSDP the rollout gathers the trained models whole (bf16
under ZeRO-3, full precision under FSDP1) on top of the KV cache. These are estimates: the plan keeps
``memory_plan.reserve_gb`` free for the CUDA context and allocator fragmentation.

With the vLLM rollout engine (``algo.generation.engine=vllm``) the KV cache row is the engine's:
it takes ``algo.generation.vllm.gpu_memory_utilization`` of the card (its weights, KV cache and
workspace), or its weights (the policy's, at ``vllm.dtype``, over ``tensor_parallel_size``; dtype
``auto`` is the policy's as a rank holds it, fp32 under DDP and FSDP mixed precision) plus
``vllm.kv_cache_gib`` when that is set. Asleep during the update (``vllm.sleep``) it holds
nothing then; awake it adds to the update's peak too.

With asynchronous rollouts (``algo.rollout.mode=async``, docs/async.md) each rank's producer
process samples on the rank's GPU while the trainer updates, so what it holds is resident beside
everything else: its copy of the policy (at the policy's dtype as a rank holds it: the weights dtype
under DeepSpeed and LoRA, full precision under DDP and FSDP mixed precision) and its KV cache (for
``algo.rollout.merge_rollouts`` rollouts, which it may sample as one batch), or,
with the vLLM engine, an engine of its own that never sleeps (the copy then stays in CPU memory),
and a CUDA context of its own (``PRODUCER_CONTEXT_GIB``).
The trainer keeps its own KV cache or engine row, for what it still samples (validation, DAPO's
extra batches, ReMax's greedy baselines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lit_rlhf.launch.strategy import strategy_kind
from lit_rlhf.models.arch import arch_of
from lit_rlhf.utils.config import ConfigError, build_config, check

GIB = 1024**3


# ------------------------------------------------------------------ the setup
@dataclass(frozen=True)
class Setup:
    """What the bytes depend on, read from a composed config."""

    strategy: str  # ddp | fsdp | zero2 | zero3
    offload_optimizer: bool
    offload_params: bool
    devices: int  # total GPUs (devices × nodes)
    mixed: bool  # bf16/fp16 mixed precision (DDP/FSDP keep fp32 weights)
    weight_bytes: int  # frozen weights' dtype
    lora: Any
    checkpointing: bool
    micro_batch: int
    seq_len: int
    gen_batch: int
    gen_len: int
    engine: Any = None  # the VLLMConfig of a vllm rollout engine; None = the hf loop
    producer: bool = False  # asynchronous rollouts: a producer process on each rank's GPU
    producer_merge: int = 1  # the rollouts it samples as one batch (algo.rollout.merge_rollouts)

    @property
    def master_weight_bytes(self) -> int:
        """Bytes per trained weight outside DeepSpeed (DDP/FSDP): fp32 under mixed precision."""
        return 4 if self.mixed or self.weight_bytes == 4 else self.weight_bytes

    @property
    def policy_weight_bytes(self) -> int:
        """Bytes per weight of the policy as a rank holds it whole (what a copy of it or a vLLM engine
        of dtype ``auto`` takes): the weights dtype under DeepSpeed and LoRA (a frozen base), full
        precision under DDP and FSDP mixed precision."""
        return self.weight_bytes if self.strategy.startswith("zero") or self.lora.enabled else self.master_weight_bytes

    def describe(self) -> str:
        s = {"ddp": "DDP", "fsdp": "FSDP full shard", "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}[
            self.strategy
        ]
        if self.offload_optimizer:
            s += " + optimizer offload"
        if self.offload_params:
            s += " + parameter offload"
        lora = f"LoRA r={self.lora.r}" if self.lora.enabled else "full fine-tuning"
        return (
            f"{s}, {self.devices} GPU{'s' if self.devices > 1 else ''}, "
            f"{'mixed precision' if self.mixed else 'fp32'}, {lora}, gradient checkpointing "
            f"{'on' if self.checkpointing else 'off'}"
        )


def trained_bytes(p: int, s: Setup, largest: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) per GPU of a trained model of ``p`` parameters."""
    n = s.devices
    if s.strategy == "zero2":
        return 2 * p, (0 if s.offload_optimizer else 2 * p / n), (0 if s.offload_optimizer else 16 * p / n)
    if s.strategy == "zero3":
        if s.offload_params:
            return 4 * largest, 0.0, 0.0
        if s.offload_optimizer:
            return 2 * p / n + 4 * largest, 0.0, 0.0
        return 2 * p / n + 4 * largest, 2 * p / n, 14 * p / n
    shard = n if s.strategy == "fsdp" else 1
    w = s.master_weight_bytes
    extra = 2 * largest if s.strategy == "fsdp" else 0  # one gathered layer (bf16)
    return w * p / shard + extra, 4 * p / shard, 8 * p / shard


@dataclass
class Row:
    name: str
    role: str  # trained | frozen | shared
    params: int
    trainable: int
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


@dataclass
class MemoryPlan:
    title: str
    setup: Setup
    rows: list[Row]
    activations: float
    activation_note: str
    kv_cache: float
    kv_note: str
    rollout_gather: float = 0.0  # ZeRO-3/FSDP: trained weights gathered whole for the rollout, beyond the shard
    producer: float = 0.0  # asynchronous rollouts: the producer's copy of the policy and its KV cache or engine
    producer_note: str = ""
    engine_sleeps: bool = False  # a vllm engine (the kv_cache row) frees its memory during the update
    notes: list[str] = field(default_factory=list)
    gpu_memory_gb: float | None = None
    reserve_gb: float = 2.0
    alternatives: list[tuple[str, float]] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return sum(r.total for r in self.rows)

    @property
    def peak(self) -> float:
        resident = 0.0 if self.engine_sleeps or not self.setup.engine else self.kv_cache  # an awake engine's share
        rollout = self.kv_cache + self.rollout_gather
        return self.model_states + self.producer + max(self.activations + resident, rollout)

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory_gb is None:
            return None
        return self.peak <= (self.gpu_memory_gb - self.reserve_gb) * GIB

    def render(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        lines = [
            f"Memory plan (estimate, per GPU): {self.title}",
            f"  {self.setup.describe()}",
            "",
            "| model | role | parameters | trainable | weights | gradients | optimizer | total |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.name} | {r.role} | {_count(r.params)} | {_count(r.trainable)} | {g(r.weights)} | "
                f"{g(r.grads)} | {g(r.optimizer)} | {g(r.total)} |"
            )
        kv = "vLLM engine" if self.setup.engine else "KV cache"
        lines += [
            f"| activations | {self.activation_note} | | | | | | {g(self.activations)} |",
            f"| {kv} | {self.kv_note} | | | | | | {g(self.kv_cache)} |",
        ]
        rollout = kv
        if self.setup.engine and not self.engine_sleeps:
            rollout = f"{kv}; the awake engine also beside the activations"
        if self.rollout_gather:
            lines.append(
                f"| rollout gather | trained weights gathered whole while sampling | | | | | | "
                f"{g(self.rollout_gather)} |"
            )
            rollout = "KV cache + rollout gather"
        states = "model states"
        if self.producer:
            lines.append(f"| rollout producer | {self.producer_note} | | | | | | {g(self.producer)} |")
            states = "model states + rollout producer"
        lines.append(f"| **peak** | {states} + max(activations, {rollout}) | | | | | | **{g(self.peak)}** |")
        lines.append("")
        if self.gpu_memory_gb is None:
            lines.append("GPU memory not set (memory_plan.gpu_memory_gb, or a visible GPU): no fit check.")
        else:
            usable = self.gpu_memory_gb - self.reserve_gb
            verdict = "FITS" if self.fits else "DOES NOT FIT"
            lines.append(
                f"{verdict}: {self.peak / GIB:.1f} GiB of {usable:.1f} GiB usable per GPU "
                f"({self.gpu_memory_gb:g} GiB - {self.reserve_gb:g} GiB reserve)."
            )
            if not self.fits:
                if self.alternatives:
                    lines.append("Switches that would make it fit:")
                    lines += [f"  {what}  ->  {peak / GIB:.1f} GiB" for what, peak in self.alternatives]
                else:
                    lines.append("No single switch makes it fit: more GPUs, a smaller model, or shorter sequences.")
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# ------------------------------------------------------------------ from a config
def setup_from(cfg: Any, job: Any) -> Setup:
    """The :class:`Setup` of a composed config ``cfg`` whose validated pieces are ``job`` (runner.plan)."""
    strategy, opt_off, par_off = strategy_kind(cfg)
    t = cfg.trainer
    devices = t.get("devices", 1)
    if not (isinstance(devices, int) and devices > 0):  # "auto" / -1: every visible GPU
        import torch

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    devices *= int(t.get("num_nodes", 1) or 1)
    precision = str(t.get("precision", "32"))
    spec = job.model
    algo, data = job.algo, job.data
    rl = getattr(job.algo_cls, "data_kind", "") == "prompt"
    gen_len = algo.generation.max_new_tokens if rl else 0
    engine = algo.generation.vllm if rl and algo.generation.engine == "vllm" else None
    if rl:  # RL stages: prompts + responses (validation-only sampling, e.g. DPO's drift, is not planned)
        prompt_len = getattr(data, "max_prompt_length", 256) or 256
        seq, gen_batch = prompt_len + gen_len, algo.rollout_batch_size
        micro = (
            getattr(algo, "micro_batch_size", None) or getattr(algo, "minibatch_size", None) or algo.rollout_batch_size
        )
    else:
        seq, gen_batch = getattr(data, "max_length", 512) or 512, 0
        micro = getattr(data, "batch_size", None) or 8
        if getattr(job.algo_cls, "data_kind", "") == "preference":
            micro *= 2  # chosen and rejected stacked
    return Setup(
        strategy=strategy,
        offload_optimizer=opt_off,
        offload_params=par_off,
        devices=devices,
        mixed="bf16" in precision or "16" in precision,
        weight_bytes={"float32": 4, "auto": 2}.get(spec.dtype, 2),
        lora=spec.lora,
        checkpointing=spec.gradient_checkpointing,
        micro_batch=int(micro),
        seq_len=int(seq),
        gen_batch=int(gen_batch),
        gen_len=int(gen_len),
        engine=engine,
        producer=bool(rl and algo.rollout.mode == "async"),
        producer_merge=int(algo.rollout.merge_rollouts) if rl and algo.rollout.mode == "async" else 1,
    )


def _tiny_vocab(spec: Any) -> int | None:
    """A tiny model's vocabulary size (its tokenizer's); None for a model read from a folder."""
    if spec.tiny is None:
        return None
    from lit_rlhf.data.tokenizers import build_tokenizer

    return len(build_tokenizer(spec))


def estimate(cfg: Any, job: Any, setup: Setup | None = None, gpu_memory_gb: float | None = None) -> MemoryPlan:
    s = setup or setup_from(cfg, job)
    spec = job.model
    notes: list[str] = []
    rows: list[Row] = []
    arch0 = None
    tiny_vocab = _tiny_vocab(spec)
    for name, role, path in job.algo_cls.planned_models(job.algo):  # each stage declares its models
        if role == "remote":  # a reward behind HTTP (lit_rlhf/rewards/remote.py): no memory on this GPU
            rows.append(Row(name, f"remote: {path}", 0, 0, 0.0, 0.0, 0.0))
            continue
        arch, source = arch_of(spec, path, tiny_vocab)
        if arch is None and path is not None:
            fallback, _ = arch_of(spec, tiny_vocab=tiny_vocab)
            if fallback is not None:
                notes.append(f"{name}: {source}; assumed the model group's architecture")
                arch = fallback
        if arch is None:
            raise ValueError(f"cannot plan the {name}: {source}")
        arch0 = arch0 or arch
        p = arch.params()
        if role == "frozen-ref" and s.lora.enabled:
            rows.append(Row(name, "actor, adapters off", p, 0, 0.0, 0.0, 0.0))
            continue
        if role.startswith("frozen"):
            rows.append(Row(name, "frozen", p, 0, float(s.weight_bytes * p), 0.0, 0.0))
            continue
        if s.lora.enabled:
            adapters = arch.lora_params(s.lora.r, list(s.lora.target_modules)) + (
                arch.hidden if name != "policy" and name != "actor" else 0
            )
            w, gr, opt = trained_bytes(adapters, replace(s, strategy="ddp" if s.strategy == "fsdp" else s.strategy), 0)
            rows.append(Row(name, "trained (LoRA)", p + adapters, adapters, s.weight_bytes * p + w, gr, opt))
            continue
        w, gr, opt = trained_bytes(p, s, arch.largest_layer_params())
        rows.append(Row(name, "trained", p, p, w, gr, opt))
    a = arch0
    b, t, h, layers = s.micro_batch, s.seq_len, a.hidden, a.layers
    trained_models = sum(1 for r in rows if r.role.startswith("trained"))
    per_layer = (2 if s.checkpointing else 34) * t * b * h
    acts = trained_models * (layers * per_layer + (34 * t * b * h if s.checkpointing else 0) + 8 * t * b * a.vocab)
    kv = 2 * layers * (s.gen_batch * (t if s.gen_batch else 0)) * a.kv_heads * a.head_dim * 2
    # sampling from sharded weights gathers the trained models whole for the rollout (docs/scaling.md §4):
    # ZeRO-3 its bf16 weights; FSDP1's summon_full_params the full-precision (fp32 under mixed) ones
    gather = 0.0
    if s.gen_batch and s.strategy in ("zero3", "fsdp"):
        full = 2 if s.strategy == "zero3" else s.master_weight_bytes
        gather = float(sum(max(0.0, full * r.params - r.weights) for r in rows if r.role == "trained"))
    kv_note = f"generation, {s.gen_batch} x {t} tokens" if s.gen_batch else "no generation"
    producer, producer_note = 0.0, ""
    if s.producer:  # always resident: its copy of the policy and KV cache, or its engine (the copy in CPU memory)
        if s.engine is None:
            producer = s.policy_weight_bytes * a.params() + float(kv) * s.producer_merge
            merge = f" for {s.producer_merge} rollouts at once" if s.producer_merge > 1 else ""
            producer_note = f"async: its copy of the policy + its KV cache{merge}"
        else:
            producer = engine_bytes(replace(s, engine=replace(s.engine, sleep=False)), a, [], gpu_memory_gb)[0]
            producer_note = "async: its vLLM engine (never asleep)"
        producer += PRODUCER_CONTEXT_GIB * GIB
        producer_note += f" + its CUDA context ({PRODUCER_CONTEXT_GIB:g} GiB), never freed"
    if s.engine is not None:
        kv, kv_note = engine_bytes(s, a, notes, gpu_memory_gb)
    title = (
        f"{spec.name_or_path or 'tiny Llama (model.tiny)'} ({_count(a.params())} parameters), {job.algo_cls.__name__}"
    )
    return MemoryPlan(
        title=title,
        setup=s,
        rows=rows,
        activations=float(acts),
        activation_note=f"{trained_models} trained model(s), micro-batch {b} x {t} tokens",
        kv_cache=float(kv),
        rollout_gather=gather,
        kv_note=kv_note,
        notes=notes,
        engine_sleeps=bool(s.engine is not None and s.engine.sleep),
        producer=float(producer),
        producer_note=producer_note,
    )


PRODUCER_CONTEXT_GIB = 0.5
"""What the async producer holds on its GPU as a process of its own, beyond its tensors: a CUDA
context (about 0.3 GiB with lazy module loading, PyTorch's default since 1.13: 287 MB against 667 MB
eager in pytorch/pytorch#86509), cuBLAS workspaces and its allocator's cached blocks. The trainer's
own context is in ``memory_plan.reserve_gb``; a second one is not, nor inside a vLLM engine's
``gpu_memory_utilization`` (vLLM counts its use from a snapshot taken after CUDA started)."""


def engine_bytes(s: Setup, a: Any, notes: list[str], gpu_memory_gb: float | None = None) -> tuple[float, str]:
    """(bytes, note) of the colocated vLLM engine per GPU: ``gpu_memory_utilization`` of the card, or
    its weights + ``kv_cache_gib``; without a GPU size, weights + the generation's KV cache."""
    e = s.engine
    dtype = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(e.dtype, s.policy_weight_bytes)
    weights = dtype * a.params() / e.tensor_parallel_size  # dtype auto: the policy's as the rank holds it
    kv = 2 * a.layers * s.gen_batch * s.seq_len * a.kv_heads * a.head_dim * dtype / e.tensor_parallel_size
    sleep = ", asleep during the update" if e.sleep else ""
    if e.kv_cache_gib is not None:
        return weights + e.kv_cache_gib * GIB, f"vLLM: weights + kv_cache_gib={e.kv_cache_gib:g}{sleep}"
    gpu = gpu_memory_gb
    if gpu is None:
        notes.append(
            "the vLLM engine is counted as its weights + this rollout's KV cache: with a GPU size "
            "(memory_plan.gpu_memory_gb) it is gpu_memory_utilization of the card"
        )
        return weights + kv, f"vLLM: weights + {s.gen_batch} x {s.seq_len} tokens of KV{sleep}"
    share = e.gpu_memory_utilization * gpu * GIB
    if share < weights + kv:
        notes.append(
            f"algo.generation.vllm.gpu_memory_utilization={e.gpu_memory_utilization:g} gives the engine "
            f"{share / GIB:.1f} GiB, less than its weights + one rollout's KV cache "
            f"({(weights + kv) / GIB:.1f} GiB): vLLM would refuse to start or queue requests"
        )
    return share, f"vLLM: gpu_memory_utilization={e.gpu_memory_utilization:g} of {gpu:g} GiB{sleep}"


SWITCHES: list[tuple[str, dict[str, Any]]] = [
    ("strategy=deepspeed_stage_2", {"strategy": "zero2", "offload_optimizer": False, "offload_params": False}),
    ("strategy=deepspeed_stage_2_offload", {"strategy": "zero2", "offload_optimizer": True, "offload_params": False}),
    ("strategy=deepspeed_stage_3", {"strategy": "zero3", "offload_optimizer": False, "offload_params": False}),
    ("model.gradient_checkpointing=true", {"checkpointing": True}),
    ("model.lora.enabled=true", {"lora": "on"}),
]


def plan_for(cfg: Any, job: Any, gpu_memory_gb: float | None = None, reserve_gb: float = 2.0) -> MemoryPlan:
    """The plan of a composed job, with the single switches that would make it fit when it does not."""
    base = setup_from(cfg, job)
    plan = estimate(cfg, job, base, gpu_memory_gb)
    plan.gpu_memory_gb, plan.reserve_gb = gpu_memory_gb, reserve_gb
    if plan.fits is False:
        usable = (gpu_memory_gb - reserve_gb) * GIB
        for label, change in SWITCHES:
            if "lora" in change:
                if base.lora.enabled:
                    continue
                change = {"lora": replace(base.lora, enabled=True)}
            alt = replace(base, **change)
            if alt == base:
                continue
            peak = estimate(cfg, job, alt, gpu_memory_gb).peak
            if peak <= usable:
                plan.alternatives.append((label, peak))
        if base.micro_batch > 1:
            # RL: algo.micro_batch_size splits the update only, generation keeps its batch
            knob = "algo.micro_batch_size" if base.gen_batch else "data.batch_size"
            for micro in (base.micro_batch // 2, 1):
                alt = replace(base, micro_batch=micro)
                peak = estimate(cfg, job, alt, gpu_memory_gb).peak
                if peak <= usable:
                    plan.alternatives.append((f"micro-batch {micro} ({knob})", peak))
                    break
    return plan


@dataclass
class PlanSettings:
    """``memory_plan.*`` (lit_rlhf/conf/train.yaml), validated by :func:`plan_settings`."""

    gpu_memory_gb: float | None = field(default=None, metadata={"gt": 0})
    """Memory of one GPU in GiB; None = the visible GPU's (none on CPU: no fit check)."""
    reserve_gb: float = field(default=2.0, metadata={"ge": 0})
    """Kept free for the CUDA context and allocator fragmentation."""
    enforce: bool = True
    """Refuse a GPU launch that the plan says cannot fit."""
    only: bool = False
    """Print the plan and exit: nothing is loaded or trained (``train.py --plan`` sets it, and
    writes no run directory)."""

    def validate(self) -> None:
        gpu = self.gpu_memory_gb
        check(gpu is None or math.isfinite(gpu), "gpu_memory_gb", f"must be a finite number of GiB, got {gpu}")
        check(math.isfinite(self.reserve_gb), "reserve_gb", f"must be a finite number of GiB, got {self.reserve_gb}")
        if gpu is not None:
            check(
                self.reserve_gb < gpu, "reserve_gb", f"must be less than gpu_memory_gb={gpu:g}, got {self.reserve_gb:g}"
            )


def plan_settings(cfg: Any) -> PlanSettings:
    """``cfg.memory_plan`` validated: an unknown key, a wrong type or a GPU memory ≤ 0 is a
    ConfigError naming ``memory_plan.<key>``."""
    node = cfg.get("memory_plan")
    if node is not None and not hasattr(node, "items"):
        raise ConfigError("memory_plan", f"must be a mapping (gpu_memory_gb, reserve_gb, enforce, only), got {node!r}")
    return build_config(PlanSettings, node, "memory_plan")


def gpu_memory_gb(cfg: Any) -> float | None:
    """``memory_plan.gpu_memory_gb`` (validated), else the first visible CUDA device's memory, else None."""
    settings = plan_settings(cfg)
    if settings.gpu_memory_gb is not None:
        return settings.gpu_memory_gb
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # pragma: no cover
        return None
    return None
