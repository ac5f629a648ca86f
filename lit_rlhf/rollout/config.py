"""``GenerationConfig`` (``algo.generation.*``): the rollout's sampling settings, apart from the
decoding loop (rollout/generate.py, which re-exports it) so that the stages' configs import
without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationConfig:
    """Sampling settings of the rollout (docs/algorithms.md §3: T 0.8, top-p 0.9, rep. pen. 1.1 for PPO)."""

    max_new_tokens: int = field(default=32, metadata={"ge": 1})
    """Longest response in tokens (EOS included); a response without EOS by then is truncated."""
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
