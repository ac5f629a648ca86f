"""lit_rlhf.launch.presets: a preset's values in Python are the ones lit_rlhf/conf/algo/<name>.yaml sets over
its typed config's defaults, and overrides merge over them without changing them."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lit_rlhf.launch.presets import CONF_DIR, composed, merged, preset
from lit_rlhf.utils.config import ConfigError


@pytest.mark.parametrize("name, schema_cls", [("grpo", "CriticFreeConfig"), ("dpo", "DPOConfig"), ("ppo", "PPOConfig")])
def test_a_preset_is_its_file_over_its_typed_defaults(name, schema_cls):
    import lit_rlhf.modules.configs as configs

    own = yaml.safe_load((CONF_DIR / "algo" / f"{name}.yaml").read_text())  # read here, not through Hydra
    own.pop("defaults")
    values = composed(name)
    for key, value in own.items():
        expected = None if key == "export_dir" else value  # a train.py run directory's, dropped
        if isinstance(value, dict):
            assert {k: values[key][k] for k in value} == value, key
        else:
            assert values[key] == expected, key
    cls = getattr(configs, schema_cls)
    for field in dataclasses.fields(cls):  # every other key: the dataclass default
        if field.name in own or field.default is dataclasses.MISSING:
            continue
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        assert values[field.name] == default, field.name


def test_overrides_merge_key_by_key_and_leave_the_preset_unchanged():
    base = composed("grpo")
    out = preset("grpo", {"generation": {"max_new_tokens": 8}}, lr=3e-4, reward_fn={"_target_": "m.f", "x": 1})
    assert out["lr"] == 3e-4 and out["generation"]["max_new_tokens"] == 8
    assert out["generation"]["temperature"] == base["generation"]["temperature"]  # the preset's others kept
    assert out["reward_fn"] == {"_target_": "m.f", "x": 1}  # an object to build replaces whole
    again = merged(base, {"lr": 1.0})
    assert base["lr"] == 1.0e-6 and again["lr"] == 1.0 and again is not base


def test_an_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match=r"no preset 'gpro'; presets: .*grpo"):
        composed("gpro")
