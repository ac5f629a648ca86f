"""train.py's pre-check of command-line overrides (lit_rlhf/utils/cli.py): unknown keys get the
typed-config message before Hydra composes; everything else is left to Hydra."""

import pytest

from lit_rlhf.utils.cli import check_overrides
from lit_rlhf.utils.config import ConfigError
from tests.conftest import ROOT

CONF = ROOT / "conf"


def error(*argv):
    with pytest.raises(ConfigError) as info:
        check_overrides(list(argv), CONF)
    return str(info.value)


def test_known_keys_pass():
    check_overrides(["algo=sft", "algo.lr=1e-3", "trainer.max_steps=5", "seed=3", "--cfg", "job"], CONF)
    check_overrides(["-m", "algo=sft,rm", "algo.lr=1e-3,3e-3"], CONF)  # both stages have lr
    check_overrides(["experiment=ppo_max_synthetic_tiny", "algo.kl_coef=0.1"], CONF)  # the experiment picks ppo_max
    check_overrides(["data=sft_file", "data.sft.source=x.jsonl", "algo=sft"], CONF)


def test_unknown_algo_key_names_the_class_the_closest_key_and_the_allowed_ones():
    msg = error("algo=sft", "algo.lrr=0.1")
    assert msg.startswith("algo.lrr: unknown key for SFTConfig. Did you mean 'lr'? Allowed keys: betas, eps,")


def test_without_a_stage_algo_keys_say_to_choose_one():
    """`python train.py` runs the demo pipeline (no algo chosen): algo.* keys need a stage."""
    msg = error("-m", "algo.lr=1e-3,3e-3", "trainer.max_steps=5")
    assert msg.startswith("algo: no algo is chosen, so algo.* keys cannot be set: choose one with algo=")
    assert "ppo_max" in msg and "sft" in msg and "runs the demo pipeline" in msg


def test_keys_only_the_typed_configs_declare_are_known():
    """Keys a preset YAML does not list exist through the schemas (lit_rlhf/utils/schemas.py):
    no '+' needed, for algo, data and model keys alike."""
    check_overrides(["algo=ppo", "algo.ppo_epochs=2", "algo.generation.top_k=5"], CONF)
    check_overrides(["algo=rm", "data.preference.margin_field=rating", "data.preference.val_fraction=0.1"], CONF)
    check_overrides(["algo=sft", "model.revision=main", "data.sft.max_samples=10"], CONF)
    assert error("algo=ppo", "algo.ppo_epoch=2").startswith("algo.ppo_epoch: unknown key for PPOConfig. Did you mean 'ppo_epochs'?")


def test_hydra_flags_are_not_overrides():
    check_overrides(["--config-name", "train", "-cn", "train", "algo=sft", "algo.lr=1e-3"], CONF)
    check_overrides(["--info", "defaults"], CONF)  # not a run: nothing to check


def test_every_value_of_a_swept_choice_is_checked():
    assert error("-m", "algo=rm,sft", "algo.beta_rm=1").startswith("algo.beta_rm: unknown key for SFTConfig")


def test_unknown_keys_outside_algo():
    assert error("algo=sft", "sed=3").startswith("sed: unknown key. Did you mean 'seed'?")
    assert error("algo=sft", "trainer.max_stepz=3").startswith("trainer.max_stepz: unknown key. Did you mean 'max_steps'?")
    check_overrides(["algo=sft", "trainer.max_steps.x=3"], CONF)  # below a leaf value: Hydra judges


@pytest.mark.parametrize("argv", [
    ["algo=sft", "+algo.extra=1"],              # adding on purpose: the typed config judges it later
    ["algo=sft", "~trainer.max_steps"],         # deletions
    ["algo=sft", "hydra.run.dir=/tmp/x"],       # Hydra's own keys
    ["algo=nosuchalgo", "algo.lr=1"],           # a bad group choice: Hydra lists the options
    ["algo=sft", "algo.lr=[unclosed"],          # a parse error: Hydra reports it
    ["--help"],
])  # fmt: skip
def test_what_hydra_judges_is_left_to_hydra(argv):
    check_overrides(argv, CONF)


def test_stage_schemas_name_each_stage_modules_own_config():
    """The light map train.py's key check names configs by (utils/schemas.py: STAGE_SCHEMAS) is each
    stage module's ``config_class``, and covers every stage the conf/algo presets build."""
    import importlib

    from omegaconf import OmegaConf

    from lit_rlhf.utils.schemas import STAGE_SCHEMAS, schema_class

    for target, name in STAGE_SCHEMAS.items():
        module, cls = target.rsplit(".", 1)
        assert getattr(importlib.import_module(module), cls).config_class is schema_class(name)
    targets = {str(OmegaConf.load(p).get("_target_")) for p in (CONF / "algo").glob("*.yaml")} - {"None"}
    assert targets and targets <= STAGE_SCHEMAS.keys()


def test_key_checks_and_printed_configs_import_neither_torch_nor_lightning(tmp_path):
    """train.py's unknown-key error and ``--cfg job`` come from the typed configs alone: neither
    imports torch, Lightning or transformers (so they answer in about a second, not after ~7 s
    of imports), as ``python -X importtime`` shows."""
    import subprocess
    import sys

    heavy = ("torch", "lightning", "transformers")
    for args, expect in ((["algo=sft", "algo.lrr=0.1"], "unknown key for SFTConfig"),
                         (["algo=dapo", "algo.generation.temprature=0.5"], "Did you mean 'temperature'?"),
                         (["model=llama7b", "algo=sft", "strategy=deepspeed_stage_2", "--cfg", "job"], "stage: 2")):  # fmt: skip
        out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}",
                              *args], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        assert expect in out.stdout + out.stderr, out.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        assert "hydra" in imported and "lit_rlhf.utils.schemas" in imported  # the measurement sees imports
        assert not imported & set(heavy), sorted(imported & set(heavy))
