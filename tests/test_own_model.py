"""The README's "Your own model and data" commands, through train.py's code path (compose + run), on
a saved Hugging Face model as a user's: a tiny random Qwen2 (head size 32) beside a byte-level BPE
tokenizer with a ChatML template, and files in TRL's conversational formats. SFT → reward model on
the SFT export → PPO-max from both exports → GRPO on a GSM8K-style file, each on a short budget and
on CPU (the README's GPU settings, ``trainer=gpu``'s bf16 and DeepSpeed, are the only overrides
besides the budget); then PPO-max with LoRA and DPO from the exports. What each stage reads is the
previous stage's export, as in the README.

Then the architecture matrix: the same chain (SFT, reward model, DPO, PPO-max, GRPO) on a saved
random model of every common family (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3, GPT-NeoX,
GPT-2, OLMo 2) and a mixture of experts (Qwen2-MoE) with the hf engine, and GRPO and LoRA PPO-max
with the vLLM engine for each dense one (the mixture of experts is refused there, by key)."""

from __future__ import annotations

import json
import math

import pytest

from lit_rlhf.launch.runner import run
from tests.conftest import compose

pytestmark = [pytest.mark.slow, pytest.mark.integration]
VLLM = pytest.mark.xdist_group("vllm")  # the tests with an engine share the worker of the other engine tests

CPU = ["trainer=cpu", "trainer.enable_progress_bar=false", "logger=csv", "model.dtype=float32"]
SHORT = ["trainer.max_steps=2", "trainer.max_epochs=-1", "trainer.val_check_interval=2"]
SHORT += ["trainer.check_val_every_n_epoch=null"]
RL = ["algo.rollout_batch_size=8", "algo.generation.max_new_tokens=8", "data.prompt.max_prompt_length=48"]
RL += ["data.prompt.val_rows=1-4", "data.prompt.train_rows=5-"]

SAYS = ["Say yes.", "Say no.", "Help me.", "Be brief.", "Hi there.", "How can I help?"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(model folder, data folder): the saved model and the four files of the README's commands."""
    import torch
    import transformers as tf

    from tests.data.test_chat import make_chat_tokenizer
    from tests.rollout.test_vllm_architectures import _config

    root = tmp_path_factory.mktemp("own")
    tok = make_chat_tokenizer("chatml", root)
    torch.manual_seed(0)
    config = _config("qwen2", len(tok))  # the architecture test's tiny Qwen2, at Qwen2's own init scale
    config.update({"max_position_embeddings": 256, "initializer_range": 0.02})
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen")
    tok.save_pretrained(root / "qwen")
    user = [{"role": "user", "content": s} for s in SAYS]
    reply = [{"role": "assistant", "content": s} for s in reversed(SAYS)]
    data = root / "data"
    data.mkdir()
    _write(data / "chat.jsonl", [{"messages": [u, a]} for u, a in zip(user * 4, reply * 4)])
    _write(
        data / "prefs.jsonl",
        [
            {"prompt": [u], "chosen": [a], "rejected": [{"role": "assistant", "content": "no"}]}
            for u, a in zip(user * 4, reply * 4)
        ],
    )
    _write(data / "prompts.jsonl", [{"prompt": [u]} for u in user * 4])
    _write(
        data / "gsm8k.jsonl",
        [
            {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(6)
            for b in range(4)
        ],
    )
    return root / "qwen", data


def _run(stage_dir, overrides):
    return run(compose([*CPU, *SHORT, *overrides], stage_dir))


@pytest.fixture(scope="module")
def chain(own, tmp_path_factory):
    """The README's commands 2 to 5 in order, each from the previous exports: {stage: (run dir, metrics)}."""
    model, data = own
    runs = tmp_path_factory.mktemp("runs")
    out = {}
    out["sft"] = (
        runs / "sft",
        _run(
            runs / "sft",
            [
                "algo=sft",
                "model=hf",
                f"model.name_or_path={model}",
                "data=chat",
                f"data.sft.source={data / 'chat.jsonl'}",
                "data.batch_size=4",
            ],
        ),
    )
    out["rm"] = (
        runs / "rm",
        _run(
            runs / "rm",
            [
                "algo=rm",
                "model=hf",
                f"model.name_or_path={runs / 'sft' / 'policy'}",
                "data=chat",
                f"data.preference.source={data / 'prefs.jsonl'}",
                "data.batch_size=4",
            ],
        ),
    )
    ppo = [
        "algo=ppo_max",
        "model=hf",
        f"algo.policy_path={runs / 'sft' / 'policy'}",
        f"algo.reward_path={runs / 'rm' / 'reward_model'}",
    ]
    ppo += ["data=chat", f"data.prompt.source={data / 'prompts.jsonl'}", "algo.minibatch_size=4", *RL]
    out["ppo_max"] = runs / "ppo_max", _run(runs / "ppo_max", ppo)
    grpo = [
        "algo=grpo",
        "model=hf",
        f"algo.policy_path={runs / 'sft' / 'policy'}",
        "data=qa_file",
        "data.prompt.template=auto",
    ]
    grpo += [
        f"data.prompt.source={data / 'gsm8k.jsonl'}",
        "data.prompt.prompt_field=question",
        "data.prompt.answer_format=gsm8k",
    ]
    grpo += [
        "algo.reward_fns=[{_target_: lit_rlhf.rewards.math_accuracy, name: accuracy}]",
        "algo.num_generations=4",
        *RL,
    ]
    out["grpo"] = runs / "grpo", _run(runs / "grpo", grpo)
    out["_ppo_overrides"] = ppo, None
    return out


def test_the_readme_commands_run_in_order_on_a_saved_model(chain):
    import os

    sft_dir, sft = chain["sft"]
    assert os.path.isfile(sft_dir / "policy" / "config.json") and sft["train/loss"] > 0
    rm_dir, rm = chain["rm"]
    assert os.path.isdir(rm_dir / "reward_model") and 0.0 <= rm["val/accuracy"] <= 1.0
    _, ppo = chain["ppo_max"]
    assert ppo["rl/iteration"] == 1.0  # 2 optimizer steps: one iteration of 2 minibatches, from the exports
    for key in ("critic/loss", "policy/loss", "stability/kl"):
        assert key in ppo, key
    _, grpo = chain["grpo"]
    assert grpo["reward/accuracy_errors"] == 0 and 0.0 <= grpo["reward/accuracy"] <= 1.0


def test_ppo_max_with_lora_and_dpo_from_the_sft_export(chain, own, tmp_path):
    ppo, _ = chain["_ppo_overrides"]
    lora = _run(tmp_path / "ppo_lora", [*ppo, "model.lora.enabled=true"])
    assert "policy/loss" in lora and "critic/loss" in lora
    assert (tmp_path / "ppo_lora" / "actor" / "adapter_config.json").is_file()  # the adapter export
    _, data = own
    sft_dir, _ = chain["sft"]
    dpo = _run(
        tmp_path / "dpo",
        ["algo=dpo", "model=hf", f"algo.policy_path={sft_dir / 'policy'}", "data=chat"]
        + [f"data.preference.source={data / 'prefs.jsonl'}", "data.batch_size=4"],
    )
    assert dpo["stability/kl"] > 0 and (tmp_path / "dpo" / "policy" / "config.json").is_file()  # it moved


# every architecture family a user is likely to bring (tests/rollout/test_vllm_architectures.py's tiny
# configs, head size 32), and a mixture of experts, which the vLLM engine refuses on CPU
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "gpt2", "olmo2"]
MOE = "qwen2_moe"


@pytest.fixture(scope="module")
def saved(own, tmp_path_factory):
    """``saved(arch)``: a tiny random ``arch`` model saved beside the own model's ChatML tokenizer, once."""
    from transformers import AutoTokenizer

    from tests.rollout.test_vllm_architectures import save_arch

    model_dir, _ = own
    done = {"qwen2": model_dir}

    def get(arch: str):
        if arch not in done:
            tok = AutoTokenizer.from_pretrained(model_dir)
            eos = tok.convert_tokens_to_ids("<|im_end|>")
            done[arch] = save_arch(arch, tok, tmp_path_factory.mktemp(arch), eos)
        return done[arch]

    return get


def _model_type(folder) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


def _moved(before, after) -> bool:
    """Whether the export in ``after`` is a model of ``before``'s architecture with other weights."""
    from safetensors.torch import load_file

    if _model_type(before) != _model_type(after):
        return False
    old, new = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    return old.keys() == new.keys() and any(not old[k].equal(new[k]) for k in old)


def _grpo(policy, data) -> list[str]:
    """The README's command 5 (GRPO on a GSM8K-style file, verifiable reward) from ``policy``."""
    out = ["algo=grpo", "model=hf", f"algo.policy_path={policy}", "data=qa_file", "data.prompt.template=auto"]
    out += [f"data.prompt.source={data / 'gsm8k.jsonl'}", "data.prompt.prompt_field=question"]
    out += ["data.prompt.answer_format=gsm8k", "algo.num_generations=4", *RL]
    return out + ["algo.reward_fns=[{_target_: lit_rlhf.rewards.math_accuracy, name: accuracy}]"]


def _ppo_lora(policy, data) -> list[str]:
    """PPO-max with LoRA adapters on actor and critic from ``policy``, a rule reward (no reward model)."""
    out = ["algo=ppo_max", "model=hf", f"algo.policy_path={policy}", "data=chat", "algo.minibatch_size=4", *RL]
    out += [f"data.prompt.source={data / 'prompts.jsonl'}", "model.lora.enabled=true", "algo.reward_path=null"]
    return out + ["algo.reward_fn={_target_: lit_rlhf.rewards.format_reward, pattern: '.*'}"]


VLLM_ENGINE = ["algo.generation.engine=vllm", "algo.generation.vllm.kv_cache_gib=0.0625", "algo.monitor_sampler=true"]


@pytest.mark.parametrize("arch", [a for a in [*ARCHS, MOE] if a != "qwen2"])  # Qwen2: the README chain above
def test_each_architecture_trains_every_stage_with_the_hf_engine(arch, saved, own, tmp_path):
    """The README's chain on a saved random model of ``arch``: SFT, the reward model on the SFT export,
    DPO and GRPO from it, PPO-max from both exports (its critic is the reward model: the value head on
    this architecture's trunk), each export still a model of ``arch``; the mixture of experts also with
    LoRA (it has no vLLM run below)."""
    _, data = own
    model = saved(arch)
    sft = _run(
        tmp_path / "sft",
        ["algo=sft", "model=hf", f"model.name_or_path={model}", "data=chat"]
        + [f"data.sft.source={data / 'chat.jsonl'}", "data.batch_size=4"],
    )
    policy = tmp_path / "sft" / "policy"
    assert math.isfinite(sft["train/loss"]) and _model_type(policy) == _model_type(model)
    rm = _run(
        tmp_path / "rm",
        ["algo=rm", "model=hf", f"model.name_or_path={policy}", "data=chat"]
        + [f"data.preference.source={data / 'prefs.jsonl'}", "data.batch_size=4"],
    )
    reward = tmp_path / "rm" / "reward_model"
    assert 0.0 <= rm["val/accuracy"] <= 1.0 and _model_type(reward) == _model_type(model)
    dpo = _run(
        tmp_path / "dpo",
        ["algo=dpo", "model=hf", f"algo.policy_path={policy}", "data=chat"]
        + [f"data.preference.source={data / 'prefs.jsonl'}", "data.batch_size=4"],
    )
    assert math.isfinite(dpo["val/loss"]) and _moved(policy, tmp_path / "dpo" / "policy")
    ppo = ["algo=ppo_max", "model=hf", f"algo.policy_path={policy}", f"algo.reward_path={reward}", "data=chat"]
    ppo += [f"data.prompt.source={data / 'prompts.jsonl'}", "algo.minibatch_size=4", *RL]
    ppo = _run(tmp_path / "ppo_max", ppo)
    assert ppo["rl/iteration"] == 1.0 and all(math.isfinite(ppo[k]) for k in ("policy/loss", "critic/loss"))
    grpo = _run(tmp_path / "grpo", _grpo(policy, data))
    assert grpo["reward/accuracy_errors"] == 0 and 0.0 <= grpo["reward/accuracy"] <= 1.0
    if arch == MOE:
        lora = _run(tmp_path / "ppo_lora", _ppo_lora(policy, data))
        assert (
            math.isfinite(lora["policy/loss"]) and (tmp_path / "ppo_lora" / "actor" / "adapter_config.json").is_file()
        )


@VLLM
@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_runs_grpo_and_lora_ppo_max_with_the_vllm_engine(arch, saved, own, tmp_path):
    """GRPO (the README's command 5 with ``engine=vllm``) and PPO-max with LoRA (adapters merged into
    the weights the engine gets) on the vLLM engine, from a saved random model of ``arch``: Gemma 2
    and 3's tied head, GPT-NeoX and OLMo 2 through vLLM's Transformers backend, GPT-2's Conv1D
    adapters. The sampler's log-probs are the trainer's (``rollout/sampler_kl``, fp32 noise), also in
    PPO-max's second iteration, after the actor moved far from its start (``stability/kl_k3`` ≫ that): the
    engine samples the updated weights. Then a model of ``arch`` built after vLLM has loaded its own
    (vLLM decorates the transformers classes it runs) builds, and its packed forward is its padded one."""
    import torch

    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.forward import response_logprobs

    _, data = own
    model = saved(arch)
    grpo = _run(tmp_path / "grpo", [*_grpo(model, data), *VLLM_ENGINE])
    assert grpo["reward/accuracy_errors"] == 0 and 0.0 <= grpo["rollout/sampler_kl"] < 1e-4  # fp32 noise
    moving = ["algo.critic_warmup_steps=0", "algo.warmup_ratio=0", "algo.lr=1e-2", "trainer.max_steps=4"]
    lora = _run(tmp_path / "ppo_lora", [*_ppo_lora(model, data), *VLLM_ENGINE, *moving, "trainer.val_check_interval=4"])
    assert lora["rl/iteration"] == 2.0 and lora["stability/kl_k3"] > 1e-2 and 0.0 <= lora["rollout/sampler_kl"] < 1e-4
    assert (tmp_path / "ppo_lora" / "actor" / "adapter_config.json").is_file()
    from transformers import AutoTokenizer

    fresh = build_causal_lm(ModelSpec(name_or_path=str(model)), AutoTokenizer.from_pretrained(model)).eval()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    with torch.no_grad():
        packed, _ = response_logprobs(fresh, ids, mask, 6, padding_free=True)
        padded, _ = response_logprobs(fresh, ids, mask, 6)
    torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-4)


@VLLM
def test_a_mixture_of_experts_with_the_vllm_engine_is_refused_by_key_through_train_py(saved, own, tmp_path):
    from lit_rlhf.utils.config import ConfigError

    _, data = own
    with pytest.raises(ConfigError, match=r"^algo.generation.engine: vLLM's CPU build cannot take synced weights"):
        _run(tmp_path / "grpo", [*_grpo(saved(MOE), data), *VLLM_ENGINE])
