"""train.py's first answers to a newcomer: --help points somewhere, --cfg job shows the chosen stage
only, --plan writes nothing (tests/launch/test_memory_plan.py), a trainer.* typo answers as fast as an
algo.* one, an argument of a third-party target is named by the runner, a secret under a group says
where secrets go, and each console event is printed once."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

from lit_rlhf.launch.cli import check_overrides, prepare
from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.utils.config import ConfigError
from tests.conftest import ROOT, compose

ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", LIT_RLHF_ROOT=str(ROOT))


def cli(*args, cwd=ROOT, python=(sys.executable,)):
    return subprocess.run(
        [*python, str(ROOT / "train.py"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def test_help_points_to_the_first_commands_not_to_the_whole_config():
    out = cli("--help")
    assert out.returncode == 0, out.stderr
    for pointer in (
        "--plan",
        "experiment=sft_synthetic_tiny",
        "the demo",
        "docs/configs.md",
        "--cfg job",
        "ckpt_path=last",
    ):
        assert pointer in out.stdout, pointer
    assert "== Config ==" not in out.stdout and "is powered by Hydra" not in out.stdout
    assert len(out.stdout.splitlines()) < 40  # Hydra's default printed the ~300-line composed config


def test_cfg_job_of_a_stage_has_no_pipeline_node():
    stage = cli("experiment=sft_synthetic_tiny", "--cfg", "job")
    demo = cli("--cfg", "job")
    assert stage.returncode == 0 and demo.returncode == 0, stage.stderr + demo.stderr
    assert "\nalgo:\n" in stage.stdout and "\npipeline:\n" not in stage.stdout
    assert "\npipeline:\n" in demo.stdout  # no stage chosen: the demo pipeline is the job


def test_stage_choices_drop_the_pipeline_and_plan_only_runs_in_place():
    conf = CONF_DIR
    assert prepare(["algo=sft", "--cfg", "job"], conf) == ["algo=sft", "~pipeline", "--cfg", "job"]
    assert prepare(["-m", "experiment=sft_synthetic_tiny,rm_synthetic_tiny", "seed=1"], conf) == [
        "-m",
        "experiment=sft_synthetic_tiny,rm_synthetic_tiny",
        "~pipeline",
        "seed=1",
    ]
    # the multirun flag written between overrides (Hydra's parser would refuse the ones after it)
    assert prepare(["pipeline=reasoning", "-m", "seed=42,1"], conf) == ["-m", "pipeline=reasoning", "seed=42,1"]
    for unchanged in (["seed=3"], ["algo=null"], ["algo=sft", "pipeline=demo"], ["--help", "algo=sft"]):
        assert prepare(unchanged, conf) == unchanged
    assert prepare(["algo=sft", "--plan"], conf) == [
        "algo=sft",
        "~pipeline",
        "memory_plan.only=true",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra.run.dir=.",
    ]
    assert "hydra.run.dir=." not in prepare(["--plan", "algo=sft", "hydra.run.dir=/tmp/x"], conf)
    with pytest.raises(ConfigError, match="algo.lrr: unknown key for SFTConfig"):
        prepare(["algo=sft", "algo.lrr=1", "--plan"], conf)


def test_a_trainer_key_is_judged_without_importing_lightning():
    """An unknown trainer.* key is judged from the composed config alone: no Lightning import (~7 s),
    no reading of its source. A Trainer argument the YAML does not list is named with Hydra's idiom
    for adding it. Measured with ``-X importtime`` in a fresh interpreter."""
    code = (
        "from lit_rlhf.launch.cli import check_overrides as c; from lit_rlhf.utils.config import ConfigError; "
        "from lit_rlhf.launch.schemas import register; register()\n"
        "for key in ('overfit_batches', 'max_stepz'):\n"
        "    try: c(['algo=sft', f'trainer.{key}=1'], 'lit_rlhf/conf')\n"
        "    except ConfigError as e: print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert "trainer.overfit_batches: unknown key." in out.stdout, out.stderr[-2000:]
    assert "that the YAML does not list: +trainer.overfit_batches=…" in out.stdout
    assert "trainer.max_stepz: unknown key. Did you mean 'max_steps'?" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and not imported & {"torch", "lightning"}


def test_an_argument_a_target_does_not_take_is_named_by_the_runner():
    """``+trainer.max_stepz=5`` (forced past the command-line check) is refused by the runner's plan
    against Trainer's signature, a callback's by its instantiation: each names the key and the
    closest argument the target takes."""
    from lit_rlhf.launch.runner import plan
    from lit_rlhf.utils.instantiate import instantiate_node

    with pytest.raises(
        ConfigError, match=r"trainer.max_stepz: unknown argument of .*Trainer.*Did you mean 'max_steps'\?"
    ):
        plan(compose(["algo=sft", "+trainer.max_stepz=5"]))
    node = compose(["algo=sft", "+callbacks.model_checkpoint.save_lst=true"]).callbacks.model_checkpoint
    with pytest.raises(
        ConfigError, match=r"callbacks.model_checkpoint.save_lst: unknown argument of .*Did you mean 'save_last'\?"
    ):
        instantiate_node(node, "callbacks.model_checkpoint")


def test_a_secret_under_a_typed_group_says_to_put_it_at_the_top_level():
    from lit_rlhf.launch.runner import plan

    with pytest.raises(
        ConfigError,
        match=r"algo.api_key: unknown key for SFTConfig. A secret goes at the top level: "
        r"\+api_key=…",
    ):
        plan(compose(["algo=sft", "+algo.api_key=abc"]))
    with pytest.raises(ConfigError, match=r"A secret goes at the top level: \+hf_token=…"):
        check_overrides(["algo=sft", "algo.hf_token=abc"], CONF_DIR)


def test_known_ads_and_harmless_warnings_are_dropped_where_emitted_and_lightning_prints_once(caplog):
    import lightning  # noqa: F401

    from lit_rlhf.utils.console import one_line_per_event

    lightning_logger = logging.getLogger("lightning")
    lightning_logger.addHandler(logging.StreamHandler())  # what `import lightning` does (once per process)
    with caplog.at_level(logging.INFO):
        one_line_per_event()
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("💡 Tip: For seamless cloud logging, try …")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU …")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    assert not [h for h in lightning_logger.handlers if type(h) is logging.StreamHandler]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        one_line_per_event()  # (catch_warnings reset the filters)
        for module in ("lightning.pytorch.utilities._pytree", "my_code"):
            warnings.warn_explicit(
                "`isinstance(treespec, LeafSpec)` is deprecated, use …", FutureWarning, "x.py", 1, module=module
            )
    assert [str(w.message)[:9] for w in caught] == ["`isinstan"]  # only the one raised outside Lightning's helper


def test_the_wandb_logger_leaves_out_the_setting_wandb_warns_about_on_every_run(tmp_path):
    """Lightning's WandbLogger passes ``anonymous=None`` to ``wandb.init``; wandb warns "The anonymous
    setting has no effect" whenever the key is present, whatever its value."""
    from lit_rlhf.utils.loggers import wandb_logger

    logger = wandb_logger(str(tmp_path), offline=True, project="p")
    assert "anonymous" not in logger._wandb_init and logger._wandb_init["project"] == "p"


@pytest.mark.parametrize(
    "algo, missing",
    [
        ("ppo_max", ["algo.reward_path", "model.name_or_path", "data.prompt.source"]),
        ("dpo", ["model.name_or_path", "data.preference.source"]),  # HH-RLHF by its hub id
    ],
)
def test_the_headline_command_offline_stops_with_one_message(algo, missing):
    """`python train.py model=llama7b algo=…` with no network: one message listing every missing
    input (no traceback, no minute of hub retries)."""
    out = cli("model=llama7b", f"algo={algo}")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and out.stderr.count("Configuration error") == 1, out.stderr
    assert f"this job cannot start; it is missing {len(missing)} input(s)" in out.stderr
    listed = [
        line.split(":")[0].split("=")[0].strip("- ") for line in out.stderr.splitlines() if line.startswith("  - ")
    ]
    assert listed == missing, out.stderr


def test_preflight_lists_every_missing_input(tmp_path, monkeypatch):
    from lit_rlhf.launch.preflight import missing_inputs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose(
        [
            "model=llama7b",
            "algo=ppo_max",
            f"algo.policy_path={tmp_path}/sft",
            "algo.reward_path=some-org/rm-7b",
            f"data.prompt.source={tmp_path}/prompts.jsonl",
        ],
        tmp_path,
    )
    lines = missing_inputs(cfg, "prompt")
    ok = compose(["model=llama7b", "algo=ppo_max", "algo.reward_fn={_target_: lit_rlhf.rewards.exact_match}"], tmp_path)
    ok.model.name_or_path = str(tmp_path)  # a folder without config.json: named too
    assert [line.split(":")[0] for line in missing_inputs(ok, "prompt")] == [
        "model.name_or_path",
        "data.prompt.source=Anthropic/hh-rlhf",
    ]
    assert [line.split(":")[0] for line in lines] == [
        "algo.policy_path",
        "algo.reward_path=some-org/rm-7b",
        f"data.prompt.source={tmp_path}/prompts.jsonl",
    ]
    assert "no such model folder" in lines[0] and "hub cannot be reached" in lines[1] and "no such file" in lines[2]
    # tiny models and embedded tasks need nothing
    assert missing_inputs(compose(["experiment=sft_synthetic_tiny"], tmp_path), "sft") == []


def test_preflight_honours_a_proxy_and_the_datasets_cache(tmp_path, monkeypatch):
    import socket

    from lit_rlhf.launch.preflight import Hub, _data_problem, hub_reachable

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://unreachable.invalid")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{server.getsockname()[1]}")
    try:
        assert hub_reachable()  # the proxy answers: the hub is reachable through it
        assert Hub().reachable()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert not hub_reachable()  # asked anew: no verdict kept from the call before
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
        assert "not a local file or folder" in _data_problem({"source": "some-org/prefs"}, "data.preference", Hub())
        (tmp_path / "some-org___prefs").mkdir()
        assert _data_problem({"source": "some-org/prefs"}, "data.preference", Hub()) is None  # cached: loads offline
    finally:
        server.close()
