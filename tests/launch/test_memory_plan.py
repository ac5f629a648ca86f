"""The memory plan (lit_rlhf/launch/memory_plan.py) against independent figures: transformers' own
parameter counts, DeepSpeed's model-state estimators, and the tensors of a real optimizer step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lit_rlhf.launch.memory_plan import Setup, trained_bytes
from lit_rlhf.models.arch import KNOWN
from lit_rlhf.models.spec import LoraSpec
from tests.conftest import ROOT, compose

P7B = KNOWN["llama-2-7b"].params()


def _setup(strategy="ddp", devices=1, **kw) -> Setup:
    base = dict(
        strategy=strategy,
        offload_optimizer=False,
        offload_params=False,
        devices=devices,
        mixed=True,
        weight_bytes=2,
        lora=LoraSpec(),
        checkpointing=True,
        micro_batch=1,
        seq_len=8,
        gen_batch=0,
        gen_len=0,
    )
    return Setup(**{**base, **kw})


@pytest.mark.parametrize("name", ["llama-2-7b", "pythia-410m"])
def test_parameter_counts_match_transformers(name):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    a = KNOWN[name]
    with torch.device("meta"):
        if a.family == "llama":
            model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=a.vocab,
                    hidden_size=a.hidden,
                    num_hidden_layers=a.layers,
                    num_attention_heads=a.heads,
                    num_key_value_heads=a.kv_heads,
                    intermediate_size=a.intermediate,
                    tie_word_embeddings=a.tied,
                )
            )
        else:
            model = GPTNeoXForCausalLM(
                GPTNeoXConfig(
                    vocab_size=a.vocab,
                    hidden_size=a.hidden,
                    num_hidden_layers=a.layers,
                    num_attention_heads=a.heads,
                    intermediate_size=a.intermediate,
                    tie_word_embeddings=False,
                )
            )
    assert a.params() == sum(p.numel() for p in model.parameters())
    if name == "llama-2-7b":
        assert a.params() == 6_738_415_616  # Llama 2's published 6.74B


def test_lora_parameter_count_matches_peft(tiny_spec, tokenizer):
    from lit_rlhf.models.arch import arch_of
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.lora import add_lora

    arch, _ = arch_of(tiny_spec, tiny_vocab=len(tokenizer))
    for targets in (["all-linear"], ["q_proj", "v_proj"]):
        model = add_lora(build_causal_lm(tiny_spec, tokenizer), LoraSpec(enabled=True, r=4, target_modules=targets))
        assert arch.lora_params(4, targets) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert arch.params() == sum(p.numel() for p in build_causal_lm(tiny_spec, tokenizer).parameters())


@pytest.mark.parametrize(
    "stage, offload_opt, offload_params",
    [
        ("zero2", False, False),
        ("zero2", True, False),
        ("zero3", False, False),
        ("zero3", True, False),
        ("zero3", True, True),
    ],
)
def test_model_states_of_7b_on_8_gpus_match_deepspeed_estimators(stage, offload_opt, offload_params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = KNOWN["llama-2-7b"].largest_layer_params()
    ours = sum(
        trained_bytes(P7B, _setup(stage, 8, offload_optimizer=offload_opt, offload_params=offload_params), largest)
    )
    if stage == "zero2":
        _, gpu = estimate_zero2_model_states_mem_needs(P7B, num_gpus_per_node=8, cpu_offload=offload_opt)
    else:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            P7B, largest, num_gpus_per_node=8, cpu_offload=offload_opt, cpu_offload_params=offload_params
        )
    assert ours == pytest.approx(gpu, abs=8)  # DeepSpeed rounds to whole bytes


def test_ddp_model_states_match_the_tensors_of_a_real_step(tiny_spec, tokenizer):
    """fp32 on one device: weights, gradients and Adam's two moments are 16 bytes per parameter."""
    from lit_rlhf.models.builders import build_causal_lm

    model = build_causal_lm(tiny_spec, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(4, 50, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    measured = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weights + grads
    measured += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    params = sum(p.numel() for p in model.parameters())
    assert measured == sum(trained_bytes(params, _setup(mixed=False, weight_bytes=4), 0))


def _plan(*overrides):
    from lit_rlhf.launch.runner import memory_plan

    return memory_plan(compose(list(overrides)))


def test_presets_fit_their_hardware_and_plain_zero2_ppo_is_refused_with_switches():
    for exp, extra in (
        ("ppo_max_llama7b_a100x8", ["algo.reward_path=/ckpt/rm"]),
        ("ppo_max_llama7b_lora_1gpu", ["algo.reward_path=/ckpt/rm"]),
        ("dpo_llama7b_a100x8", []),
    ):
        p = _plan(f"experiment={exp}", *extra)
        assert p.fits is True, p.render()
    lora = _plan("experiment=ppo_max_llama7b_lora_1gpu", "algo.reward_path=/ckpt/rm")
    assert [r.name for r in lora.rows if r.weights == 0] == ["reference"]  # the adapters-off actor: no copy
    plain = _plan("experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm", "strategy=deepspeed_stage_2")
    assert plain.fits is False
    switches = [s for s, _ in plain.alternatives]
    # ZeRO-3 is no switch here: its rollout gathers actor and critic whole (bf16), 2 x (12.55 - 2.32) GiB
    # beyond their shards, on top of the 8 GiB KV cache
    assert switches == ["strategy=deepspeed_stage_2_offload", "model.lora.enabled=true"]
    assert "DOES NOT FIT" in plain.render() and "model.lora.enabled=true" in plain.render()
    zero3 = _plan("experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm", "strategy=deepspeed_stage_3")
    assert zero3.rollout_gather / 2**30 == pytest.approx(2 * (12.55 - 2.32), abs=0.01)
    assert zero3.peak == zero3.model_states + zero3.kv_cache + zero3.rollout_gather
    assert "| rollout gather |" in zero3.render() and "| rollout gather |" not in plain.render()
    # FSDP1 gathers the full-precision (fp32) weights: 4 bytes x 6.74B = 25.1 GiB each, less the 3.51 GiB shard
    fsdp = _plan("experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm", "strategy=fsdp")
    assert fsdp.rollout_gather / 2**30 == pytest.approx(2 * (4 * 6.738e9 / 2**30 - 3.51), abs=0.02)


def test_the_vllm_engine_is_counted_as_its_share_of_the_card_or_its_weights_and_kv_cache():
    """engine=vllm: the KV-cache row becomes the engine's — gpu_memory_utilization × the card, or the
    policy's bf16 weights + kv_cache_gib — outside the update's peak when it sleeps, inside when not."""
    gib = 2**30
    base = [
        "experiment=ppo_max_llama7b_a100x8",
        "algo.reward_path=/ckpt/rm",
        "memory_plan.gpu_memory_gb=80",
        "algo.generation.engine=vllm",
    ]
    hf = _plan(*base[:3])
    share = _plan(*base)
    assert share.kv_cache == pytest.approx(0.3 * 80 * gib) and share.engine_sleeps
    assert share.model_states == hf.model_states
    assert share.peak == pytest.approx(share.model_states + max(share.activations, 0.3 * 80 * gib))
    awake = _plan(*base, "algo.generation.vllm.sleep=false")
    assert awake.peak == pytest.approx(awake.model_states + share.activations + 0.3 * 80 * gib)
    fixed = _plan(*base, "algo.generation.vllm.kv_cache_gib=4")
    assert fixed.kv_cache == pytest.approx(2 * P7B + 4 * gib)  # bf16 weights of the policy + 4 GiB
    assert "| vLLM engine | vLLM: weights + kv_cache_gib=4, asleep during the update |" in fixed.render()
    small = _plan(*base, "algo.generation.vllm.gpu_memory_utilization=0.1")  # 8 GiB < 12.55 GiB of weights
    assert any("gpu_memory_utilization=0.1 gives the engine 8.0 GiB" in n for n in small.notes)


def test_a_gpu_launch_that_cannot_fit_is_refused_before_loading():
    from lit_rlhf.launch.runner import check_memory_plan, plan
    from lit_rlhf.utils.config import ConfigError

    cfg = compose(
        [
            "model=llama7b",
            "algo=ppo_max",
            "algo.reward_path=/ckpt/rm",
            "trainer.accelerator=gpu",
            "trainer.devices=1",
            "memory_plan.gpu_memory_gb=80",
        ]
    )
    with pytest.raises(ConfigError, match="memory_plan: this job does not fit the GPU memory"):
        check_memory_plan(cfg, plan(cfg))
    cpu = compose(
        ["model=llama7b", "algo=ppo_max", "algo.reward_path=/ckpt/rm", "trainer=cpu", "memory_plan.gpu_memory_gb=80"]
    )
    check_memory_plan(cpu, plan(cpu))  # CPU runs are not planned
    unknown = compose(
        [
            "model=llama7b",
            "model.name_or_path=some-org/unknown-7b",
            "algo=sft",
            "trainer.accelerator=gpu",
            "memory_plan.gpu_memory_gb=80",
        ]
    )
    check_memory_plan(unknown, plan(unknown))  # an architecture not readable offline: a warning, not a refusal


@pytest.mark.slow
def test_train_py_plan_prints_the_table_exits_and_writes_nothing(tmp_path):
    """``train.py … --plan``: the table, exit code 2 when the job does not fit (for scripts), and no run
    directory left behind (it used to leave an empty logs/<stage>/runs/<time>/)."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "experiment=ppo_max_llama7b_a100x8",
            "algo.reward_path=/ckpt/rm",
            "strategy=deepspeed_stage_2",
            f"paths.log_dir={tmp_path / 'logs'}",
            "--plan",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]  # does not fit: a non-zero exit for scripts
    assert "| actor | trained | 6.74B |" in out.stdout and "DOES NOT FIT" in out.stdout
    assert "strategy=deepspeed_stage_2_offload" in out.stdout
    assert sorted(os.listdir(tmp_path)) == []


def test_a_plan_that_fits_or_has_no_gpu_to_check_is_not_a_failure(capsys):
    """``--plan`` exits 0 unless the plan says the job does not fit (train.py: print_memory_plan is False
    only then); a CPU job has no GPU memory to check."""
    from lit_rlhf.launch.runner import print_memory_plan

    assert print_memory_plan(compose(["experiment=sft_synthetic_tiny"])) is None
    assert "Memory plan" in capsys.readouterr().out


def test_async_rollouts_count_the_producers_copy_and_sampler_beside_everything():
    """algo.rollout.mode=async: each rank's producer holds a copy of the policy (bf16 under DeepSpeed,
    fp32 under DDP's mixed precision) and its KV cache (for each rollout it samples in one batch),
    or a vLLM engine that never sleeps (its copy
    of the policy in CPU memory), and a CUDA context of its own (0.5 GiB), all resident beside the
    update; the trainer's own rows stay (it still samples for validation)."""
    gib = 2**30
    base = ["experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm", "memory_plan.gpu_memory_gb=80"]
    asynchronous = [*base, "algo.rollout.mode=async", "algo.rollout_correction=decoupled"]
    sync, hf = _plan(*base), _plan(*asynchronous)
    assert sync.producer == 0 and "| rollout producer |" not in sync.render()
    assert hf.kv_cache == sync.kv_cache and hf.model_states == sync.model_states
    ctx = 0.5 * gib  # the producer's own CUDA context
    assert hf.producer == pytest.approx(2 * P7B + sync.kv_cache + ctx)
    assert hf.peak == pytest.approx(sync.peak + 2 * P7B + sync.kv_cache + ctx)
    row = (
        "| rollout producer | async: its copy of the policy + its KV cache + its CUDA context (0.5 GiB), never freed |"
    )
    assert row in hf.render()
    assert "model states + rollout producer + max(" in hf.render()
    ddp = _plan(*asynchronous, "strategy=ddp")
    assert ddp.producer == pytest.approx(4 * P7B + sync.kv_cache + ctx)  # DDP keeps fp32 weights under bf16-mixed
    merged = _plan(*asynchronous, "algo.rollout.max_staleness=2", "algo.rollout.merge_rollouts=2")
    assert merged.producer == pytest.approx(2 * P7B + 2 * sync.kv_cache + ctx)  # two rollouts' KV cache at once
    assert "its KV cache for 2 rollouts at once + its CUDA context (0.5 GiB), never freed |" in merged.render()
    # a vLLM engine of dtype auto has the policy's dtype as the rank holds it: fp32 under DDP mixed precision
    fixed = [*asynchronous, "strategy=ddp", "algo.generation.engine=vllm", "algo.generation.vllm.kv_cache_gib=4"]
    assert _plan(*fixed).producer == pytest.approx(4 * P7B + 4 * gib + ctx)
    assert _plan(*fixed, "algo.generation.vllm.dtype=bfloat16").producer == pytest.approx(2 * P7B + 4 * gib + ctx)
    vllm = _plan(*asynchronous, "algo.generation.engine=vllm")  # asleep in the trainer, awake in the producer
    assert vllm.producer == pytest.approx(0.3 * 80 * gib + ctx)
    assert "| rollout producer | async: its vLLM engine (never asleep) + its CUDA context (0.5 GiB), never freed |" in (
        vllm.render()
    )
    assert vllm.peak == pytest.approx(vllm.model_states + vllm.producer + max(vllm.activations, 0.3 * 80 * gib))
