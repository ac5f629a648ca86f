"""train.py's pre-check of command-line overrides (lit_rlhf/launch/cli.py): unknown keys get the
typed-config message before Hydra composes (one compose of the command's choices); everything
else is left to Hydra."""

import pytest
from omegaconf import OmegaConf

from lit_rlhf.launch.cli import check_overrides
from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.utils.config import ConfigError
from tests.conftest import ROOT

CONF = CONF_DIR


def error(*argv):
    with pytest.raises(ConfigError) as info:
        check_overrides(list(argv), CONF)
    return str(info.value)


SECTIONS = {
    "model": "model",
    "data.sft": "sft_data",
    "data.preference": "preference_data",
    "data.prompt": "prompt_data",
}


def typed_values(overrides: list[str], tmp_path) -> dict[str, object]:
    """Every field of the typed configs a command line composes to (algo, model, data sections),
    flattened to dotted keys: what the stage would be built with."""
    from lit_rlhf.launch.schemas import STAGE_SCHEMAS, schema_class
    from lit_rlhf.utils.config import build_config, to_dict
    from tests.conftest import compose

    cfg = compose(overrides, tmp_path)
    nodes = {"algo": STAGE_SCHEMAS[cfg.algo._target_], **SECTIONS}
    out = {}

    def flatten(prefix, value):
        if isinstance(value, dict) and value:
            for k, v in value.items():
                flatten(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for key, schema in nodes.items():
        node = OmegaConf.select(cfg, key)
        if node is not None:
            flatten(key, to_dict(build_config(schema_class(schema), node, key)))
    return out


def assert_overrides_reach_the_typed_configs(choices: list[str], overrides: dict[str, object], tmp_path):
    """The pre-check passes the command line through untouched, and Hydra + the typed configs then
    set exactly the overridden fields to the given values: every other field keeps the value it has
    without the overrides, and each overridden field had another value before."""
    argv = [*choices, *(f"{k}={v}" for k, v in overrides.items())]
    check_overrides(list(argv), CONF)  # passes: nothing to refuse
    before, after = typed_values(choices, tmp_path), typed_values(argv, tmp_path)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == set(overrides), sorted(changed ^ set(overrides))
    for key, value in overrides.items():
        assert after[key] == value and before[key] != value, key


def test_known_keys_pass_and_set_their_fields(tmp_path):
    """Keys a preset YAML does not list exist through the schemas: no '+' needed, for algo, data and
    model keys alike, and each reaches its typed field (with a stage chosen directly, by an
    experiment, and with a data file)."""
    assert_overrides_reach_the_typed_configs(
        ["algo=sft"], {"algo.lr": 1e-3, "model.revision": "main", "data.sft.max_samples": 10}, tmp_path
    )
    # the experiment picks ppo_max (with the RL stage's required paths)
    assert_overrides_reach_the_typed_configs(
        ["experiment=ppo_max_synthetic_tiny", "algo.policy_path=/m/sft", "algo.reward_path=/m/rm"],
        {"algo.kl_coef": 0.1, "algo.ppo_epochs": 2, "algo.generation.top_k": 5},
        tmp_path,
    )
    assert_overrides_reach_the_typed_configs(
        ["algo=rm"], {"data.preference.margin_field": "rating", "data.preference.val_fraction": 0.1}, tmp_path
    )
    assert_overrides_reach_the_typed_configs(
        ["data=sft_file", "data.sft.source=x.jsonl", "algo=sft"], {"data.sft.prompt_field": "question"}, tmp_path
    )
    for argv in (
        ["algo=sft", "algo.lr=1e-3", "trainer.max_steps=5", "seed=3", "--cfg", "job"],
        ["-m", "algo=sft,rm", "algo.lr=1e-3,3e-3"],
    ):  # both stages have lr
        check_overrides(list(argv), CONF)
    assert error("algo=ppo", "algo.ppo_epoch=2").startswith(
        "algo.ppo_epoch: unknown key for PPOConfig. Did you mean 'ppo_epochs'?"
    )


def test_hydra_flags_and_their_values_are_not_overrides():
    """The value after ``--cfg``/``-cn`` is skipped (were ``job`` read as an override, the line
    would not parse and nothing would be checked): the overrides around the flags are still checked."""
    argv = ["--config-name", "train", "-cn", "train", "algo=sft", "algo.lr=1e-3", "--cfg", "job"]
    check_overrides(list(argv), CONF)
    assert error("--cfg", "job", "-cn", "train", "algo=sft", "algo.lrr=1").startswith(
        "algo.lrr: unknown key for SFTConfig"
    )
    # --info (like --help) runs no job: nothing is checked, not even an unknown key
    check_overrides(["algo=sft", "algo.lrr=1", "--info"], CONF)


def test_unknown_algo_key_names_the_class_the_closest_key_and_the_allowed_ones():
    msg = error("algo=sft", "algo.lrr=0.1")
    assert msg.startswith("algo.lrr: unknown key for SFTConfig. Did you mean 'lr'? Allowed keys: betas, eps,")


def test_without_a_stage_algo_keys_say_to_choose_one():
    """`python train.py` runs the demo pipeline (no algo chosen): algo.* keys need a stage."""
    msg = error("-m", "algo.lr=1e-3,3e-3", "trainer.max_steps=5")
    assert msg.startswith("algo: no algo is chosen, so algo.* keys cannot be set: choose one with algo=")
    assert "ppo_max" in msg and "sft" in msg and "runs the demo pipeline" in msg


def test_a_swept_choice_is_checked_by_its_first_value():
    """One compose: the first job's choices (Hydra composes each job and refuses a key of a later
    one in that job)."""
    assert error("-m", "algo=sft,rm", "algo.beta_rm=1").startswith("algo.beta_rm: unknown key for SFTConfig")
    check_overrides(["-m", "algo=rm,sft", "algo.beta_rm=1"], CONF)


def test_unknown_keys_outside_algo():
    assert error("algo=sft", "sed=3").startswith("sed: unknown key. Did you mean 'seed'?")
    assert error("algo=sft", "trainer.max_stepz=3").startswith(
        "trainer.max_stepz: unknown key. Did you mean 'max_steps'?"
    )
    argv = ["algo=sft", "trainer.max_steps.x=3"]  # below a leaf value: Hydra judges
    check_overrides(list(argv), CONF)  # no error of its own


def _hydra_refuses(pattern):
    def then(argv, tmp_path):
        from tests.conftest import compose

        with pytest.raises(Exception, match=pattern):
            compose(argv, tmp_path)

    return then


def _typed_config_refuses_extra(argv, tmp_path):  # '+' adds the key; the typed config judges it when the job starts
    from lit_rlhf.launch.schemas import schema_class
    from lit_rlhf.utils.config import build_config
    from tests.conftest import compose

    cfg = compose(argv, tmp_path)
    assert cfg.algo.extra == 1
    with pytest.raises(ConfigError, match=r"algo\.extra: unknown key for SFTConfig"):
        build_config(schema_class("sft"), cfg.algo, "algo")


def _deleted(argv, tmp_path):
    from tests.conftest import compose

    assert "max_steps" not in compose(argv, tmp_path).trainer


@pytest.mark.parametrize(
    "argv, then",
    [
        (["algo=sft", "+algo.extra=1"], _typed_config_refuses_extra),  # adding on purpose
        (["algo=sft", "~trainer.max_steps"], _deleted),  # deletions
        (["algo=sft", "hydra.run.dir=/tmp/x"], None),  # Hydra's own keys
        (
            ["algo=nosuchalgo", "algo.lr=1"],
            _hydra_refuses(r"(?s)nosuchalgo.*Available options"),
        ),  # Hydra lists the options
        (
            ["algo=sft", "algo.lr=[unclosed"],
            _hydra_refuses(r"no viable alternative at input '\[unclosed'"),
        ),  # a parse error
        (["--help"], None),
    ],
    ids=["plus", "delete", "hydra-key", "bad-choice", "parse-error", "help"],
)
def test_what_hydra_judges_is_left_to_hydra(argv, then, tmp_path):
    """The pre-check lets these through (no error of its own); Hydra,
    or the typed config when the job starts, then judges them."""
    check_overrides(list(argv), CONF)  # no error of its own
    if then is not None:
        then(argv, tmp_path)


def test_stage_schemas_name_each_stage_modules_own_config():
    """The light maps train.py's checks name configs and data sections by (launch/schemas.py:
    STAGE_SCHEMAS, STAGE_DATA_KINDS) are each stage module's ``config_class`` and ``data_kind``, and
    cover every stage the lit_rlhf/conf/algo presets build."""
    import importlib

    from omegaconf import OmegaConf

    from lit_rlhf.launch.schemas import STAGE_DATA_KINDS, STAGE_SCHEMAS, schema_class

    assert STAGE_DATA_KINDS.keys() == set(STAGE_SCHEMAS.values())
    for target, name in STAGE_SCHEMAS.items():
        module, cls = target.rsplit(".", 1)
        stage = getattr(importlib.import_module(module), cls)
        assert stage.config_class is schema_class(name) and stage.data_kind == STAGE_DATA_KINDS[name], target
    targets = {str(OmegaConf.load(p).get("_target_")) for p in (CONF / "algo").glob("*.yaml")} - {"None"}
    assert targets and targets <= STAGE_SCHEMAS.keys()


def test_key_checks_and_printed_configs_import_neither_torch_nor_lightning(tmp_path):
    """train.py's unknown-key errors (an override Hydra refuses, and a ``+key`` it accepts that the
    stage's config does not have), a job's missing inputs and ``--cfg job`` come from the typed configs
    alone: none imports torch, Lightning or transformers (so they answer in about a second, not after
    ~9 s of imports), as ``python -X importtime`` shows (runner.check_before_imports)."""
    import subprocess
    import sys

    heavy = ("torch", "lightning", "transformers")
    for args, expect in (
        (["algo=sft", "algo.lrr=0.1"], "unknown key for SFTConfig"),
        (["algo=sft", "+algo.lrr=0.1"], "Configuration error: algo.lrr: unknown key for SFTConfig"),
        (["algo=dpo", "algo.beta=-1"], "Configuration error: algo.beta"),
        (["model=llama7b", "algo=ppo_max"], "this job cannot start; it is missing 3 input(s)"),
        (["algo=dapo", "algo.generation.temprature=0.5"], "Did you mean 'temperature'?"),
        (["model=llama7b", "algo=sft", "strategy=deepspeed_stage_2", "--cfg", "job"], "stage: 2"),
    ):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert expect in out.stdout + out.stderr, out.stderr[-2000:]
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
        }
        assert "hydra" in imported and "lit_rlhf.launch.schemas" in imported  # the measurement sees imports
        assert not imported & set(heavy), sorted(imported & set(heavy))
