"""``GenerationConfig`` (``algo.generation.*``): the rollout's sampling settings, apart from the
decoding loop (rollout/generate.py, which re-exports it) so that the stages' configs import
without torch; ``RolloutModeConfig`` (``algo.rollout.*``): synchronous or asynchronous rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class VLLMConfig:
    """``algo.generation.vllm.*``: the colocated vLLM engine (``algo.generation.engine=vllm``;
    lit_rlhf/rollout/vllm_engine.py, docs/scaling.md §5). One engine per training process (and one
    in each async rollout producer, docs/async.md), built from the policy's config at the first
    rollout, its weights replaced by the trained policy's before every rollout that follows an
    optimizer step."""

    gpu_memory_utilization: float = field(default=0.3, metadata={"gt": 0.0, "le": 1.0})
    """The fraction of the card vLLM may take (its weights, KV cache and workspace), beside the
    training state (TRL's colocate default, 0.3); the memory plan counts it. On CPU vLLM reads it as
    the fraction of the host's memory (prefer ``kv_cache_gib`` there)."""
    kv_cache_gib: float | None = field(default=None, metadata={"gt": 0.0})
    """The KV cache's size in GiB instead (vLLM's ``kv_cache_memory_bytes``; the tests use 1/16);
    None = sized from gpu_memory_utilization."""
    tensor_parallel_size: int = field(default=1, metadata={"ge": 1})
    """Shards of the engine over the ranks of one node (colocated: each rank holds one shard, and
    a TP group samples the same prompts). 1 = every rank samples its own prompts."""
    max_model_len: int | None = field(default=None, metadata={"ge": 2})
    """Longest prompt + response the engine holds; None = the policy's ``max_position_embeddings``."""
    enforce_eager: bool | None = None
    """Eager PyTorch instead of CUDA graphs / torch.compile; None = eager on CPU (compilation costs
    more than a CPU rollout gains), graphs on GPU."""
    dtype: str = "auto"
    """The engine's dtype; auto = the policy's as a rank holds it (bf16 under DeepSpeed and LoRA on
    GPU presets, fp32 under DDP and FSDP mixed precision and on CPU)."""
    sleep: bool = True
    """GPU: free the engine's weights and KV cache between rollouts (vLLM sleep mode, level 2:
    nothing kept, the next sync refills the weights) so the update has the memory; woken and
    re-synced before the next rollout. No effect on CPU."""
    seed: int = 0
    """Added to the per-rollout seed drawn from torch's generator (the run's seed and the checkpoint's
    RNG state decide the samples: resumes are exact)."""


@dataclass
class GenerationConfig:
    """Sampling settings of the rollout (docs/algorithms.md §3: T 0.8, top-p 0.9, rep. pen. 1.1 for PPO)."""

    engine: Literal["hf", "vllm"] = "hf"
    """Who samples: hf = lit_rlhf's KV-cache decoding loop over the policy itself (rollout/generate.py;
    the CPU default); vllm = a colocated vLLM engine (``vllm.*`` below; docs/scaling.md §5), its
    weights synced from the policy before each rollout. The log-probs the update uses are always
    the trainer's own recomputation; the sampler's can be monitored (``algo.monitor_sampler``)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Settings of the vllm engine (ignored with engine=hf)."""
    max_new_tokens: int = field(default=32, metadata={"ge": 1})
    """Longest response in tokens (EOS included); a response without EOS by then is truncated. Both
    engines also stop where the policy's positions end (its ``max_position_embeddings``; vLLM's
    ``max_model_len``), with a warning."""
    temperature: float = field(default=1.0, metadata={"gt": 0.0})
    """Logits are divided by it before sampling (< 1 sharper, > 1 flatter)."""
    top_p: float = field(default=1.0, metadata={"gt": 0.0, "le": 1.0})
    """Nucleus sampling: keep the most likely tokens holding this much probability (1.0 = off)."""
    top_k: int = field(default=0, metadata={"ge": 0})
    """0 = no top-k filter."""
    repetition_penalty: float = field(default=1.0, metadata={"gt": 0.0})
    """CTRL penalty on tokens already in the prompt or response (1.0 = off)."""
    do_sample: bool = True
    """False = greedy (evaluation)."""
    inline_layers: bool = True
    """Decode Llama-layout decoder layers (Llama, Mistral, Qwen2) with lit_rlhf's own layer step
    (rollout/decode_step.py: the layers' ops without the module plumbing), checked once per model
    against the model's forward on its first decoding step and dropped, with a warning, if they
    differ. False = the model's own forward at every step (slower on CPU; and no prepacking)."""
    prepack: bool = True
    """fp32 on CPU: decode with oneDNN-prepacked copies of the decoder layers' projections and the LM
    head (q/k/v and gate/up each as one product; one extra copy of those weights while sampling;
    equal to the model's forward up to float rounding; skipped, with a warning, when the copy would
    take more than half of the memory available). False = the layers' own ops, bit for bit.
    No effect elsewhere (GPU, bf16, LoRA or hooked layers)."""


@dataclass
class RolloutModeConfig:
    """``algo.rollout.*``: who samples when (docs/async.md). sync: each RL iteration samples its own
    rollout, then trains on it. async: a producer process (lit_rlhf/rollout/producer.py) samples the
    rollouts of the iterations ahead while the trainer trains, with weights at most ``max_staleness``
    policy versions old; the update weighs them with ``algo.rollout_correction``."""

    mode: Literal["sync", "async"] = "sync"
    """sync, or async (either engine; alone or under any strategy, DDP, ZeRO-2/3 or FSDP, with a
    producer per rank on the rank's CPU or CUDA GPU; a correction is required)."""
    max_staleness: int = field(default=1, metadata={"ge": 0})
    """Policy versions a sample may lag (async): the rollout iteration k trains on was sampled with
    the weights of an iteration ≥ k − max_staleness (a version is the policy after an RL iteration,
    all its minibatch steps). The producer starts no more than this many rollouts ahead. 0: the
    producer samples each rollout with the weights and the random state the synchronous run would
    have used: the synchronous run, draw for draw, in another process."""
    merge_rollouts: int = field(default=1, metadata={"ge": 1})
    """The most rollouts the producer samples as one batch (async, bound ≥ 1): when it starts one, it
    also takes those after it that the bound admits with the same weights (it is behind), and cuts
    the sample back into each rollout at its own width. A wider batch decodes more tokens per second
    (the hf loop on one CPU thread, the bench model: two rollouts in 1.6× the time of one); a merged
    rollout may be sampled with older weights than if it had waited its turn (up to max_staleness − 1
    versions older), within the bound. 1 = one at a time; at most max_staleness + 1. Only batches
    of the prompt loader's keys merge (a PPO-ptx run's pretraining batch does not), and with the hf
    loop only prompts short enough that the model's positions cut no response. The hf loop's KV
    cache grows with the batch (the memory plan counts it). docs/async.md §1."""
    producer_threads: int | None = field(default=None, metadata={"ge": 1})
    """torch threads of the producer; the trainer keeps the rest of its own (at least one) and
    validates with all of them. None = half of the trainer's (at least one); at bound 0, where
    nothing overlaps, all of them (and the trainer keeps its own)."""
    reference_scoring: Literal["trainer", "producer", "balanced"] = "trainer"
    """Where the frozen reference's log-probs of each sample are computed (runs with a reference;
    the producer's reference shares the trainer's memory, never a copy; on a GPU: the trainer only).
    trainer: after the sample is taken. producer: where it is sampled (work moved off the trainer,
    for runs whose update takes longer than their sampling). balanced: both, the producer the first
    rows of each sample and the trainer the rest, the producer's share moving toward the split that
    leaves both sides equally busy (docs/async.md §1)."""
    restarts: int = field(default=1, metadata={"ge": 0})
    """A producer that dies (killed, out of memory) is started again this many times in a run, its
    unfinished rollouts sampled again; once more and the run stops with an error naming this key."""
    timeout_s: float = field(default=1200.0, metadata={"gt": 0.0})
    """A rollout the producer has not delivered this long after the trainer asked for it stops the
    run with an error (a hung producer: a tool that never returns, a dead lock). On several ranks,
    keep it below the process group's timeout (30 min unless the strategy sets one): the other
    ranks wait for the hung one at the next collective, and it must stop them, with a checkpoint,
    before that wait times out."""
