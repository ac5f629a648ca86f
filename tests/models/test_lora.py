"""LoRA (lit_rlhf/models/lora.py): the reference is the base model with the adapters off, merging
and adapter exports agree with peft's own code, and a LoRA stage trains adapters and heads only."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.models.lora import AdaptersDisabled, add_lora, lora_layers, merged_state_dict, save_adapter
from lit_rlhf.models.spec import LoraSpec

SPEC = LoraSpec(enabled=True, r=4, alpha=8.0, dropout=0.1)


def _ids(n: int = 3, t: int = 7) -> torch.Tensor:
    return torch.randint(4, 60, (n, t), generator=torch.Generator().manual_seed(0))


def _adapted(tiny_spec, tokenizer):
    """(base copy, model with random non-zero adapters): B = 0 at init would make every check trivial."""
    torch.manual_seed(0)
    base = build_causal_lm(tiny_spec, tokenizer).eval()
    model = add_lora(copy.deepcopy(base), SPEC)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    return base, model


def test_only_adapters_train(tiny_spec, tokenizer):
    _, model = _adapted(tiny_spec, tokenizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(lora_layers(model)) == 7  # q, k, v, o, gate, up, down of the one block; not the (tied) LM head


def test_adapters_disabled_is_the_base_model(tiny_spec, tokenizer):
    base, model = _adapted(tiny_spec, tokenizer)
    model.train()
    ids = _ids()
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        adapted = model.eval()(input_ids=ids).logits
    model.train()
    assert not torch.allclose(adapted, expected, atol=1e-3)  # the adapters change the model
    reference = AdaptersDisabled(model)
    torch.testing.assert_close(reference(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert model.training and all(m.training for m in model.modules())  # modes restored
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)  # adapters trainable again
    # the eval mode matters: in train mode the adapters' dropout is active, not the reference's
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_merged_weights_match_peft_merge_and_the_adapted_model(tiny_spec, tokenizer):
    from peft import LoraConfig, get_peft_model

    base, model = _adapted(tiny_spec, tokenizer)
    merged = merged_state_dict(model)
    assert merged.keys() == base.state_dict().keys()
    # independently: peft's own PeftModel with the same adapter weights, merged by peft
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=SPEC.r, lora_alpha=SPEC.alpha, target_modules="all-linear")
    )
    ours = model.state_dict()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(ours[name.removeprefix("base_model.model.")])
    reference = peft_model.merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6, msg=k)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def _gpt2(tokenizer):
    """A tiny random GPT-2: its attention and MLP projections are transformers' Conv1D, weight (in, out)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return GPT2LMHeadModel(config).eval()


def test_gpt2_conv1d_layers_are_adapted_merged_and_exported(tokenizer, tmp_path):
    """GPT-2's Conv1D projections take adapters (peft's fan_in_fan_out): the merged weight is
    W + (α/r)(BA)ᵀ, equal to peft's own merge and to the adapted model's logits; the adapter export
    loads with peft and as a model path."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from lit_rlhf.models.spec import ModelSpec

    base = _gpt2(tokenizer)
    model = add_lora(copy.deepcopy(base), SPEC)
    layers = lora_layers(model)
    assert len(layers) == 4 and all(isinstance(x.base_layer, Conv1D) and x.fan_in_fan_out for x in layers.values())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    merged = merged_state_dict(model)
    assert merged.keys() == base.state_dict().keys()
    peft_model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=SPEC.r, lora_alpha=SPEC.alpha, target_modules="all-linear", fan_in_fan_out=True),
    )
    ours = model.state_dict()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(ours[name.removeprefix("base_model.model.")])
    for k, v in peft_model.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6, msg=k)
    ids = _ids()
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        assert not torch.allclose(base(input_ids=ids).logits, expected, atol=1e-3)  # the adapters act
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    save_adapter(model, SPEC, str(tmp_path / "base"), str(tmp_path / "adapter"))
    tokenizer.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(
            build_causal_lm(ModelSpec(name_or_path=str(tmp_path / "base"))), str(tmp_path / "adapter")
        ).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        ours = build_causal_lm(ModelSpec(name_or_path=str(tmp_path / "adapter"))).eval()
        torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_adapter_export_loads_with_peft_and_as_a_model_path(tiny_spec, tokenizer, tmp_path):
    from peft import PeftModel

    from lit_rlhf.models.spec import ModelSpec

    base, model = _adapted(tiny_spec, tokenizer)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    save_adapter(model, SPEC, str(tmp_path / "base"), str(tmp_path / "adapter"))
    tokenizer.save_pretrained(tmp_path / "adapter")
    ids = _ids()
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(
            build_causal_lm(ModelSpec(name_or_path=str(tmp_path / "base"))), str(tmp_path / "adapter")
        ).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        ours = build_causal_lm(ModelSpec(name_or_path=str(tmp_path / "adapter"))).eval()  # base + adapter, merged
        assert not lora_layers(ours)
        torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ppo_with_lora_trains_adapters_and_heads_only(saved_models, tokenizer):
    """A LoRA PPO fit: the actor's and the critic trunk's base weights are the saved policy's,
    bit for bit; adapters and the value head moved; the reference is the adapters-off actor."""
    from safetensors.torch import load_file

    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config
    from tests.helpers.ppo import data, fit

    cfg = build_config(
        PPOConfig,
        dict(
            policy_path=saved_models[0],
            reward_path=saved_models[1],
            lr=1e-2,
            critic_lr=1e-2,
            rollout_batch_size=8,
            minibatch_size=4,
            generation={"max_new_tokens": 6},
        ),
        "algo",
    )
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path="unused", lora=SPEC))
    module = PPOModule(cfg, model=spec, tokenizer=tokenizer)
    fit(module, data(tokenizer), max_steps=4)
    assert isinstance(module.frozen["reference"], AdaptersDisabled) and module.frozen["reference"].model is module.actor
    saved = load_file(f"{saved_models[0]}/model.safetensors")
    actor = module.actor.state_dict()
    for name, value in actor.items():
        if ".lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        if key in saved:
            assert torch.equal(value, saved[key]), name  # frozen base
    moved = [n for n, v in actor.items() if ".lora_B." in n and v.abs().max() > 0]
    assert moved, "the actor's adapters did not train (B stays 0 otherwise)"
    critic = module.critic.state_dict()
    assert any(".lora_B." in n and v.abs().max() > 0 for n, v in critic.items())  # its own adapters
    assert all(p.requires_grad for p in module.critic.head.parameters())
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or n.startswith("critic.head.") for n in trainable), sorted(trainable)[:5]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "grpo", "reinforce_pp", "remax"])
def test_every_stage_trains_lora_through_the_config(stage, tmp_path, saved_models):
    """`model.lora.enabled=true` on the command line of each stage: one fast_dev_run batch with
    finite metrics, and an export of the right kind that a later stage can load (which parameters
    train is checked on PPO above)."""
    from lit_rlhf.launch.runner import run
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.lora import is_adapter_dir
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from tests.conftest import compose

    policy, rm = f"algo.policy_path={saved_models[0]}", f"algo.reward_path={saved_models[1]}"
    extra = {
        "sft": ["experiment=sft_synthetic_tiny", "model.tiny.hidden_size=32", "model.tiny.num_attention_heads=2"],
        "rm": [
            "experiment=rm_synthetic_tiny",
            "model.tiny=null",
            "model.tokenizer=null",
            f"model.name_or_path={saved_models[0]}",
        ],
        "dpo": ["experiment=dpo_synthetic_tiny", policy],
        "grpo": ["experiment=grpo_synthetic_tiny", policy, rm, "validate_before_fit=false"],
        "reinforce_pp": ["experiment=reinforce_pp_synthetic_tiny", policy, rm, "validate_before_fit=false"],
        "remax": ["experiment=remax_synthetic_tiny", policy, rm, "validate_before_fit=false"],
    }[stage]
    cfg = compose(
        [
            *extra,
            "model.lora.enabled=true",
            "model.lora.r=4",
            "debug=fdr",
            "trainer.enable_progress_bar=false",
            "logger=none",
        ],
        tmp_path,
    )
    metrics = run(cfg)
    assert metrics and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    out = tmp_path / {"sft": "policy", "rm": "reward_model", "dpo": "policy"}.get(stage, "actor")
    if stage == "rm":
        assert not is_adapter_dir(str(out))  # a reward model exports merged (backbone + head)
        assert not lora_layers(load_reward_model(str(out)))
    elif stage == "sft":
        assert not is_adapter_dir(str(out))  # a tiny base has no path to name: merged
        assert not lora_layers(build_causal_lm(ModelSpec(name_or_path=str(out))))
    else:  # a policy trained from a saved base: the adapter, loadable as a model path (merged on load)
        assert is_adapter_dir(str(out)) and not (out / "model.safetensors").exists()
        assert not lora_layers(build_causal_lm(ModelSpec(name_or_path=str(out))))
