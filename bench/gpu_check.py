"""GPU check for a lent accelerator (one CUDA GPU, under 9 minutes): PPO-max with a ~85M-parameter
Llama for a few iterations under DeepSpeed ZeRO-2 and ZeRO-3 (bf16), FSDP (fp32 weights, bf16-mixed)
and with LoRA (bf16-mixed, one device); and ``vllm``: ZeRO-2 with the colocated vLLM rollout engine
(``algo.generation.engine=vllm``, bf16, gpu_memory_utilization 0.3, asleep during the update), whose
rollout tokens/s are compared with a standalone ``vllm.LLM`` of the same trained policy (its own
process memory, same prompts and sampling) instead of bare ``generate``; and ``async``: ZeRO-2 with
asynchronous rollouts (``algo.rollout.mode=async``, bound 1, the decoupled correction: a producer
process samples on the same GPU while the trainer updates), whose step time compares with
``zero2``'s, its rollout tokens/s are the producer's sampling, and its peak memory is the most the
GPU had in use during the run (both processes' reserved memory and contexts: ``torch.cuda.mem_get_info``
every 20 ms; the other variants' is the trainer's allocated peak) against the plan, which counts the
producer.

    bash bench/gpu_check.sh            # = python bench/gpu_check.py, writes bench/results/gpu_check.md

Reports per variant: median step time, rollout tokens/s against bare ``generate`` of the same
model, peak GPU memory (``torch.cuda.max_memory_allocated``) against the memory plan's estimate
(lit_rlhf/launch/memory_plan.py), and the model FLOPs utilisation (MFU) against the GPU's dense bf16 peak:
FLOPs per iteration = 2·P·(generated tokens) + 4 scoring forwards 2·P·T + actor and critic
training 2 × 6·P·T (T = all tokens of the rollout batch; P = policy parameters).

Each variant runs in its own process (clean CUDA and DeepSpeed state). On one GPU ZeRO-3 and FSDP
shard nothing, but they exercise the whole-model build or per-model wrapping, the once-per-rollout
gather and the export gather.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    hidden=768, layers=12, heads=12, inter=2048, batch=32, prompt_len=16, new_tokens=128, iterations=6, warmup=2
)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}
VARIANTS = ["zero2", "zero3", "fsdp", "lora", "vllm", "async"]


def build(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_rlhf.data.synthetic import build_tokenizer
    from lit_rlhf.models.reward import RewardModel

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=SHAPE["hidden"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        intermediate_size=SHAPE["inter"],
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder / "policy")
    tok.save_pretrained(folder / "policy")
    RewardModel(LlamaForCausalLM(cfg), "causal_lm", "last").save_pretrained(str(folder / "rm"))
    tok.save_pretrained(folder / "rm")


def run_variant(variant: str, folder: Path) -> dict:
    import lightning.pytorch as pl
    import torch
    from omegaconf import OmegaConf

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.memory_plan import estimate
    from lit_rlhf.launch.presets import preset
    from lit_rlhf.models.spec import LoraSpec, ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config

    s = SHAPE
    cfg = build_config(
        PPOConfig,
        preset(
            "ppo",
            dict(
                policy_path=str(folder / "policy"),
                reward_path=str(folder / "rm"),
                export_dir=None,
                rollout_batch_size=s["batch"],
                minibatch_size=s["batch"] // 4,
                lr=1e-5,
                critic_lr=1e-5,
                score_norm="normalize",
                kl_coef=0.05,
                critic_warmup_steps=0,
                **(
                    {"rollout": {"mode": "async", "max_staleness": 1}, "rollout_correction": "decoupled"}
                    if variant == "async"
                    else {}
                ),
                generation={
                    "max_new_tokens": s["new_tokens"],
                    "top_p": 1.0,
                    "top_k": 0,
                    "engine": "vllm" if variant == "vllm" else "hf",
                    "vllm": {"gpu_memory_utilization": 0.3},
                },
            ),
        ),
        "algo",
    )
    lora = LoraSpec(enabled=variant == "lora", r=16, alpha=32.0)
    dtype = "float32" if variant == "fsdp" else "bfloat16"  # FSDP's mixed precision keeps fp32 weights
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(folder / "policy"), dtype=dtype, lora=lora))
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(
        n_train=s["batch"] * 20, n_val=0, batch_size=s["batch"], max_prompt_length=s["prompt_len"]
    ).connect(tok)
    if variant in ("zero2", "zero3", "vllm", "async"):
        from lit_rlhf.runtime.strategies import RLHFDeepSpeedStrategy

        stage = int(variant[-1]) if variant.startswith("zero") else 2
        strategy: object = RLHFDeepSpeedStrategy(
            config={
                "zero_optimization": {"stage": stage},
                "bf16": {"enabled": True},
                "gradient_clipping": 1.0,
                "zero_allow_untested_optimizer": True,
                "train_micro_batch_size_per_gpu": s["batch"] // 4,
            }
        )
        precision = "bf16-mixed"
        trainer_strategy = f"deepspeed_stage_{stage}"
    elif variant == "fsdp":
        from lit_rlhf.runtime.strategies import RLHFFSDPStrategy

        strategy = RLHFFSDPStrategy(
            wrap_layers=["transformers.models.llama.modeling_llama.LlamaDecoderLayer"],
            sharding_strategy="FULL_SHARD",
            state_dict_type="full",
        )
        precision, trainer_strategy = "bf16-mixed", "fsdp"
    else:
        strategy, precision, trainer_strategy = "auto", "bf16-mixed", "auto"

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.stamps, self.rollout_s, self.tokens, self.total_tokens = [], [], [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            r = outputs["rollout"]
            sampled = "async/producer_sample_s" if variant == "async" else "perf/rollout_s"
            self.rollout_s.append(float(outputs["stats"][sampled]))
            self.tokens.append(float(r.response_ids.numel()))  # sampled positions (batch x decoding steps)
            self.total_tokens.append(float(r.attention_mask.sum()))

    probe = Probe()
    torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=s["iterations"] * 4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[probe],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    used, running = [0], threading.Event()

    def watch_the_gpu() -> None:  # the whole GPU's memory in use: an async run's producer too
        while running.is_set():
            free, total = torch.cuda.mem_get_info()
            used[0] = max(used[0], total - free)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_the_gpu, daemon=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    running.set()
    watcher.start()
    try:
        trainer.fit(module, data)
    finally:
        running.clear()
        watcher.join()
    peak = used[0] if variant == "async" else torch.cuda.max_memory_allocated()
    stamps = [start] + probe.stamps
    steps = [b - a for a, b in zip(stamps, stamps[1:])][s["warmup"] :]
    step_s = statistics.median(steps)
    rollout_tok_s = statistics.median(
        t / r for t, r in zip(probe.tokens[s["warmup"] :], probe.rollout_s[s["warmup"] :])
    )

    # bare generate of the same (trained) policy: the ceiling of the rollout's sampling
    actor = module.actor.eval()
    prompts = next(iter(data.train_dataloader()))
    ids, mask = prompts["prompt_ids"].cuda(), prompts["prompt_mask"].cuda()
    rates = []
    if variant == "vllm":
        bare_tok_s = standalone_vllm(actor, ids, mask, folder)
    else:
        bare_tok_s = None
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = actor.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=s["new_tokens"],
                do_sample=True,
                top_k=0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id,
            )
            torch.cuda.synchronize()
            rates.append(ids.shape[0] * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
            if bare_tok_s is not None:
                break
    bare_tok_s = bare_tok_s if bare_tok_s is not None else statistics.median(rates[1:])

    p = sum(x.numel() for n, x in module.actor.named_parameters() if ".lora_" not in n)
    tokens, total = statistics.median(probe.tokens), statistics.median(probe.total_tokens)
    flops = 2 * p * tokens + 4 * 2 * p * total + 2 * 6 * p * total
    name = torch.cuda.get_device_name(0)
    peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)

    job = type("Job", (), {"model": spec, "algo": cfg, "data": data.config, "algo_cls": PPOModule})()
    plan_cfg = OmegaConf.create(
        {
            "trainer": {"devices": 1, "num_nodes": 1, "precision": precision},
            "strategy": {
                "_target_": "lit_rlhf.runtime.strategies.RLHFDeepSpeedStrategy",
                "config": {"zero_optimization": {"stage": int(trainer_strategy[-1])}},
            }
            if trainer_strategy.startswith("deepspeed")
            else {"_target_": "lit_rlhf.runtime.strategies.RLHFFSDPStrategy"}
            if trainer_strategy == "fsdp"
            else "auto",
        }
    )
    plan = estimate(plan_cfg, job, gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30)
    return {
        "variant": variant,
        "gpu": name,
        "policy_params": p,
        "step_s": step_s,
        "rollout_tokens_per_s": rollout_tok_s,
        "bare_generate_tokens_per_s": bare_tok_s,
        "peak_gib": peak / 2**30,
        "plan_gib": plan.peak / 2**30,
        "tflops": flops / step_s / 1e12,
        "mfu": (flops / step_s / peak_flops) if peak_flops else None,
    }


def standalone_vllm(actor, ids, mask, folder: Path) -> float:
    """Tokens/s of a standalone ``vllm.LLM`` loading the trained policy from disk (after the run's
    engine was released by the module's teardown), on the same prompts with the same sampling
    settings (T 1, no filters)."""
    import gc

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    gc.collect()
    torch.cuda.empty_cache()
    actor.save_pretrained(folder / "trained")
    llm = LLM(
        model=str(folder / "trained"),
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        skip_tokenizer_init=True,
        generation_config="vllm",
    )
    rows = [TokensPrompt(prompt_token_ids=r[m.bool()].tolist()) for r, m in zip(ids.cpu(), mask.cpu())]
    params = SamplingParams(temperature=1.0, max_tokens=SHAPE["new_tokens"], detokenize=False)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(rows, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.md"))
    ap.add_argument(
        "--variants",
        nargs="*",
        choices=VARIANTS,
        default=VARIANTS,
        help="run only these (vllm: needs the CUDA `vllm` package)",
    )
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, Path(args.models))))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        for variant in args.variants:
            env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
            proc = subprocess.run(
                [sys.executable, __file__, "--variant", variant, "--models", tmp],
                env=env,
                capture_output=True,
                text=True,
                timeout=420,
            )
            if proc.returncode != 0:
                results.append({"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            else:
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    lines = [
        "| variant | GPU | step s | rollout tok/s | bare generate (vllm: standalone vLLM) tok/s | peak GiB | plan GiB "
        "| TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} | | | | | | | |")
            continue
        mfu = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['variant']} | {r['gpu']} | {r['step_s']:.3f} | {r['rollout_tokens_per_s']:.0f} | "
            f"{r['bare_generate_tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['plan_gib']:.2f} | "
            f"{r['tflops']:.1f} | {mfu} |"
        )
    table = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
