import time

import pytest
import torch

from lit_rlhf.data.tokenizers import build_tokenizer, prepare_tokenizer
from lit_rlhf.models.builders import ModelLoadError, build_causal_lm, freeze
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.utils.config import ConfigError, build_config


def test_tiny_llama_from_config(tiny_spec, tokenizer):
    model = build_causal_lm(tiny_spec, tokenizer)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.eos_token_id == tokenizer.eos_token_id
    out = model(input_ids=torch.tensor([[2, 4, 5]]))
    assert out.logits.shape == (1, 3, len(tokenizer))


def test_local_path_round_trip(tiny_spec, tokenizer, tmp_path):
    model = build_causal_lm(tiny_spec, tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = tiny_spec.at_path(str(tmp_path))
    again = build_causal_lm(spec, build_tokenizer(spec))
    x = torch.tensor([[2, 10, 11, 12]])
    torch.testing.assert_close(again(input_ids=x).logits, model(input_ids=x).logits)


def test_offline_hub_name_fails_with_how_to_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = ModelSpec(name_or_path="NousResearch/Llama-2-7b-hf")
    t0 = time.time()
    with pytest.raises(ModelLoadError) as err:
        build_tokenizer(spec)
    msg = str(err.value)
    assert "NousResearch/Llama-2-7b-hf" in msg and "model.name_or_path=/path/to/Llama-2-7b-hf" in msg
    assert "huggingface-cli download" in msg
    assert time.time() - t0 < 30


def test_local_dir_without_weights_says_so(tmp_path):
    with pytest.raises(ModelLoadError, match="from local directory"):
        build_causal_lm(ModelSpec(name_or_path=str(tmp_path), tokenizer="synthetic"))


def test_trust_remote_code_is_off_by_default_and_passed(monkeypatch, tmp_path):
    import transformers

    seen = {}

    def fake(name, **kw):
        seen.update(kw)
        raise OSError("stop")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    with pytest.raises(ModelLoadError):
        build_causal_lm(ModelSpec(name_or_path="some/model"))
    assert seen["trust_remote_code"] is False
    with pytest.raises(ModelLoadError):
        build_causal_lm(ModelSpec(name_or_path="some/model", trust_remote_code=True))
    assert seen["trust_remote_code"] is True


def test_prepare_tokenizer_pad_fallbacks():
    class Tok:
        def __init__(self, unk):
            self.pad_token, self.unk_token, self.eos_token, self.padding_side = None, unk, "</s>", "right"

    t = prepare_tokenizer(Tok("<unk>"))
    assert t.pad_token == "<unk>" and t.padding_side == "left"
    assert prepare_tokenizer(Tok(None)).pad_token == "</s>"


def test_spec_validation():
    with pytest.raises(ConfigError, match="model.name_or_path: set exactly one"):
        build_config(ModelSpec, {"name_or_path": None}, "model")
    with pytest.raises(ConfigError, match="model.tokenizer: a tiny model has no tokenizer"):
        build_config(ModelSpec, {"tiny": {}}, "model")
    with pytest.raises(ConfigError, match="model.tiny.hidden_size: must be divisible by num_attention_heads=3"):
        build_config(
            ModelSpec, {"tiny": {"hidden_size": 32, "num_attention_heads": 3}, "tokenizer": "synthetic"}, "model"
        )
    with pytest.raises(ConfigError, match="model.dtype: must be one of"):
        build_config(ModelSpec, {"name_or_path": "x", "dtype": "fp8"}, "model")


def test_gradient_checkpointing_and_freeze(tiny_spec, tokenizer):
    spec = ModelSpec(tiny=tiny_spec.tiny, tokenizer="synthetic", gradient_checkpointing=True)
    model = build_causal_lm(spec, tokenizer)
    assert model.is_gradient_checkpointing
    freeze(model)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_a_value_transformers_refuses_names_the_key_in_one_line(monkeypatch):
    """A hub name whose loading raises ValueError because of a value we passed (here a revision):
    one ModelLoadError naming model.revision (train.py prints it as one line), not a traceback."""
    import transformers

    def refuse(name, **kw):
        raise ValueError(f"revision {kw['revision']!r} is not a valid git identifier\nmore detail")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(ModelLoadError) as err:
        build_causal_lm(ModelSpec(name_or_path="some/model", revision="no such"))
    assert str(err.value) == (
        "Could not load the model 'some/model' (model.revision): revision 'no such' is not a valid git identifier"
    )
