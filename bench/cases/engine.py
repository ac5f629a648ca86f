"""The vLLM rollout engine (``algo.generation.engine=vllm``) on CPU: its sampling tokens/s on the
bench model (against the hf engine and bare ``generate``: cases in generation.py), a PPO-max step
with it (against ``ppo_ours``), and the time of one weight sync on the bench model and on a
103M-parameter Llama (with the async producer's weight path beside it). No target on CPU: vLLM's
CPU path is not what it is for; the figures say what it costs here (README, "Benchmark")."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .common import prompts, timed

KV = {"kv_cache_gib": 0.5}


def case_generate_vllm(models: Path, s: dict) -> dict:
    """The vllm engine sampling the bench prompts (T 0.7, as generate_ours), weights synced once."""
    import torch

    from lit_rlhf.data.collate import pad
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.config import GenerationConfig, VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    model = build_causal_lm(spec, tok)
    started = time.perf_counter()
    engine = VLLMEngine(model, VLLMConfig(**KV))
    engine.sync(model, 0)
    build_s = time.perf_counter() - started
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=s["new_tokens"], temperature=0.7)
    tokens = []

    def go():
        torch.manual_seed(0)
        _, m, _, _ = engine.sample(ids, mask, gen, tok.eos_token_id, tok.pad_token_id)
        tokens.append(int(m.sum()))

    t = timed(go, s["warmup"], s["steps"])
    return {
        "step_s": t,
        "tokens_per_s": s["batch"] * s["new_tokens"] / t,
        "response_tokens_mean": statistics.mean(tokens),
        "engine_start_s": build_s,
    }


def _sync_seconds(model, repeats: int = 5) -> float:
    from lit_rlhf.rollout.config import VLLMConfig
    from lit_rlhf.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, VLLMConfig(**KV))
    times = []
    for version in range(repeats + 1):
        t0 = time.perf_counter()
        engine.sync(model, version)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first sync also warms the engine's reload path


def case_sync_engine(models: Path, s: dict, smoke: bool = False) -> dict:
    """Median seconds of one weight sync of the colocated vLLM engine (all parameters pushed, prefix
    cache reset: ``*_sync_s``), and of the async producer's weight path: the trainer's write to the
    board (``*_board_publish_s``), the producer's read into its copy (``*_board_read_s``), and, for
    comparison, the least a server reload from files adds (``*_file_s``: the weights written as
    safetensors to /dev/shm, memory, and read back; the server's load is then the engine's sync).
    The bench policy (``bench_*``), and (not in smoke mode) a 103M-parameter Llama (hidden 768, 12
    layers, vocab 24,000: ``big_*``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec

    spec = ModelSpec(name_or_path=str(models / "policy"))
    model = build_causal_lm(spec, build_tokenizer(spec))
    out = {"bench_params": sum(p.numel() for p in model.parameters()), "bench_sync_s": _sync_seconds(model)}
    out.update(_weight_path_seconds(model, "bench"))
    if s["hidden"] >= 256:  # the full shapes only
        torch.manual_seed(0)
        big = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=24000,
                hidden_size=768,
                num_hidden_layers=12,
                num_attention_heads=12,
                intermediate_size=2048,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            )
        ).eval()
        out.update(big_params=sum(p.numel() for p in big.parameters()), big_sync_s=_sync_seconds(big, 3))
        out.update(_weight_path_seconds(big, "big", 3))
    return out


def _weight_path_seconds(model, name: str, repeats: int = 5) -> dict:
    """Medians over ``repeats`` of the async producer's weight path (lit_rlhf/rollout/producer.py: a
    board publish, then a read into the producer's copy) and of a safetensors round trip through
    /dev/shm (the files a server that reloads from disk would read)."""
    import os
    import tempfile

    import torch.multiprocessing as mp
    from safetensors.torch import load_file, save_model

    from lit_rlhf.rollout.producer import (
        WeightBoard,
        check_shared_memory,
        own_weights,
        policy_replica,
        trained_tensors,
    )

    tensors = trained_tensors(model, True)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    check_shared_memory(2 * size)  # the board and the files: an error where /dev/shm is small, not a SIGBUS
    board = WeightBoard(tensors, 0, mp.get_context("spawn"))
    replica = policy_replica(model, board.tensors, True)
    own_weights(replica, board.tensors)
    publish, read, files, serial = [], [], [], 0
    for version in range(1, repeats + 2):
        t0 = time.perf_counter()
        board.publish(tensors, version, lambda: True)
        t1 = time.perf_counter()
        _, serial = board.read(replica, version, serial)
        publish.append(t1 - t0)
        read.append(time.perf_counter() - t1)
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
            t0 = time.perf_counter()
            save_model(model, f"{tmp}/model.safetensors")  # tied weights once, as save_pretrained
            load_file(f"{tmp}/model.safetensors")
            files.append(time.perf_counter() - t0)
    # the first of each warms its path (page faults of fresh shared memory)
    return {
        f"{name}_board_publish_s": statistics.median(publish[1:]),
        f"{name}_board_read_s": statistics.median(read[1:]),
        f"{name}_file_s": statistics.median(files[1:]),
    }
