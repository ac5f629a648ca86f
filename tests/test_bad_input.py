"""Bad input ends in a message naming the file and line, or the key: never a library traceback."""

import gzip
import json
import logging

import pytest

from lit_rlhf.data.io import DataError, iter_rows
from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.launch.runner import build, plan, run
from lit_rlhf.utils.config import ConfigError
from tests.conftest import CPU_FAST, compose


def test_invalid_utf8_names_file_and_line(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff\xfe", "response": "c"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: not valid UTF-8 \(byte 12 of the line"):
        list(iter_rows(str(bad)))
    js = tmp_path / "pairs.json"
    js.write_bytes(b'[\n{"prompt": "a"},\n{"prompt": "\xff"}\n]')
    with pytest.raises(DataError, match=rf"{js}:3: not valid UTF-8"):
        list(iter_rows(str(js)))


def test_truncated_gzip_names_the_file_and_the_last_good_line(tmp_path):
    full = gzip.compress(
        b"".join(json.dumps({"prompt": f"p{i}", "response": "r" * 50}).encode() + b"\n" for i in range(200))
    )
    bad = tmp_path / "pairs.jsonl.gz"
    bad.write_bytes(full[: len(full) // 2])
    with pytest.raises(DataError, match=rf"{bad}: unreadable after line \d+ \(EOFError.*truncated"):
        list(iter_rows(str(bad)))


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=abc", r"trainer.max_steps: expected an integer, got 'abc'"),
        ("trainer.precision=bf17", r"trainer.precision: expected .*'bf16-mixed'.*got 'bf17'"),
        (
            "+trainer.max_stpes=3",
            r"trainer.max_stpes: unknown argument of Trainer.__init__. Did you mean 'max_steps'\?",
        ),
    ],
)
def test_trainer_values_are_checked_by_key(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose([override], tmp_path))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"ckpt_path: no such checkpoint file: .*missing.ckpt"),
        (b"", r"ckpt_path: .*bad.ckpt is not a complete checkpoint \(not a torch archive"),
        (b"PK\x03\x04 not really a zip", r"ckpt_path: .*bad.ckpt is not a complete checkpoint"),
    ],
)
def test_a_bad_ckpt_path_is_named_before_anything_is_built(content, message, tmp_path, monkeypatch):
    import lit_rlhf.launch.runner as runner

    path = tmp_path / ("missing.ckpt" if content is None else "bad.ckpt")
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(runner, "build", lambda cfg: pytest.fail("built a model before checking ckpt_path"))
    with pytest.raises(ConfigError, match=message):
        run(compose([*CPU_FAST, f"ckpt_path={path}"], tmp_path))


def test_a_truncated_checkpoint_is_refused(tmp_path):
    import torch

    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, good)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[:-200])
    from lit_rlhf.runtime.checkpoint_io import check_checkpoint_path

    check_checkpoint_path(str(good))
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        check_checkpoint_path(str(cut))


@pytest.mark.parametrize("kind", ["missing", "empty", "not_a_model"])
def test_a_bad_policy_path_names_the_algo_key(kind, tmp_path, saved_models):
    path = tmp_path / "sft"
    if kind != "missing":
        path.mkdir()
    if kind == "not_a_model":
        (path / "notes.txt").write_text("hello")
    cfg = compose(
        [
            "experiment=ppo_synthetic_tiny",
            f"algo.policy_path={path}",
            f"algo.reward_path={saved_models[1]}",
            *CPU_FAST[:4],
        ],
        tmp_path,
    )
    message = {
        "missing": "no such model folder",
        "empty": "has no config.json \\(empty folder\\)",
        "not_a_model": "has no config.json \\(found: notes.txt\\)",
    }[kind]
    with pytest.raises(ConfigError, match=rf"algo.policy_path: .*{message}"):
        build(cfg)


def test_blank_and_duplicated_prompts_are_counted(tmp_path, tokenizer, caplog):
    from lit_rlhf.data.prompts import PromptDataModule

    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the dog", "", "   ", "the dog", "a cat"]) + "\n")
    dm = PromptDataModule(source=str(src), batch_size=2, format="prompt").connect(tokenizer)
    with caplog.at_level(logging.INFO, logger="lit_rlhf.data.prompts"):
        dm.setup("fit")
    assert [p for _, p in dm.train_set] == ["the dog", "the dog", "a cat"]
    assert (dm.stats["train_skipped_empty"], dm.stats["train_duplicates"]) == (2, 1)
    assert "2 empty or blank skipped; 1 duplicates kept" in caplog.text
    (tmp_path / "blank.jsonl").write_text(json.dumps({"prompt": " "}) + "\n")
    with pytest.raises(DataError, match="no usable prompts \\(1 read, all empty or blank\\)"):
        PromptDataModule(source=str(tmp_path / "blank.jsonl"), batch_size=2, format="prompt").connect(tokenizer).setup(
            "fit"
        )


def test_a_minibatch_larger_than_the_rollout_is_reported(saved_models, tokenizer, caplog):
    from tests.helpers.ppo import make

    with caplog.at_level(logging.WARNING, logger="lit_rlhf.modules.ppo"):
        make(saved_models, tokenizer, minibatch_size=32)
    assert "algo.minibatch_size=32 > algo.rollout_batch_size=8: each update uses the whole rollout of 8" in caplog.text


def test_callable_arguments_missing_from_the_yaml_take_a_plus_and_typos_are_refused():
    """A target's argument its YAML does not list takes Hydra's ``+`` (the message says so); with
    it the override passes the check and reaches the target."""
    from lit_rlhf.launch.cli import check_overrides

    for key in ("callbacks.model_checkpoint.every_n_train_steps", "trainer.gradient_clip_algorithm"):
        with pytest.raises(ConfigError, match=rf"{key}: unknown key.*: \+{key}=…"):
            check_overrides(["algo=sft", f"{key}=5"], CONF_DIR)
    check_overrides(["algo=sft", "+callbacks.model_checkpoint.every_n_train_steps=5"], CONF_DIR)
    with pytest.raises(ConfigError, match=r"model_checkpoint.save_lst: unknown key. Did you mean 'save_last'\?"):
        check_overrides(["algo=sft", "callbacks.model_checkpoint.save_lst=true"], CONF_DIR)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "algo.reward_fns=[{_target_:lit_rlhf.data.synthetic.gold_reward_fn,weight:heavy}]",
            r"algo.reward_fns\[0\].weight: must be a finite number, got 'heavy'",
        ),
        (
            "algo.reward_fns=[{_target_:lit_rlhf.data.synthetic.gold_reward_fn},{_target_:lit_rlhf.data.synthetic.gold_rewrd_fn}]",
            r"algo.reward_fns\[1\]._target_: cannot import 'lit_rlhf.data.synthetic.gold_rewrd_fn'",
        ),
        (
            "algo.reward_fns=[{_target_:lit_rlhf.data.synthetic.gold_reward_fn,name:a},{_target_:lit_rlhf.data.synthetic.gold_reward_fn,name:a}]",
            r"algo.reward_fns\[1\].name: 'a' already names reward_fns\[0\]",
        ),
        (
            "model.lora.enabled=true model.lora.target_modules=[]",
            r"model.lora.target_modules: must name at least one module",
        ),
        ("model.lora.enabled=true model.lora.r=0", r"model.lora.r: must be >= 1, got 0"),
        ("model.lora.dropout=1.5", r"model.lora.dropout: must be >= 0.0 and < 1.0, got 1.5"),
    ],
)
def test_list_entries_and_lora_values_fail_in_the_plan_naming_the_key(override, message, tmp_path):
    cfg = compose(["experiment=grpo_synthetic_tiny", *override.split()], tmp_path)
    with pytest.raises(ConfigError, match=message):
        plan(cfg)


@pytest.mark.parametrize(
    "targets, message",
    [
        ("[nope_proj]", r"peft: Target modules \{'nope_proj'\} not found in the base model"),
        ("[norm]", r"peft: Target module LlamaRMSNorm\(.*\) is not supported"),  # peft's multi-line message, one line
        (
            "[embed_tokens]",
            r"model.embed_tokens is a Embedding: only linear layers \(nn.Linear, transformers. Conv1D\) can be adapted",
        ),
    ],
)
def test_a_target_module_peft_refuses_is_a_config_error_naming_the_key(targets, message, tmp_path):
    """The model is needed to know its module names: the stage builds it, peft refuses, and the
    user gets one line naming model.lora.target_modules instead of peft's traceback."""
    cfg = compose([*CPU_FAST, "model.lora.enabled=true", f"model.lora.target_modules={targets}"], tmp_path)
    _, _, module = build(cfg)
    with pytest.raises(ConfigError, match=rf"^model.lora.target_modules: {message}") as err:
        module.configure_model()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", r"memory_plan.gpu_memory_gb: must be > 0, got -1.0"),
        ("0", r"memory_plan.gpu_memory_gb: must be > 0, got 0.0"),
    ],
)
def test_a_gpu_memory_that_is_not_a_plan_names_the_key(value, message, tmp_path):
    """A negative or zero GPU memory used to plan against -1 GiB (a refusal that blamed the job) or,
    for 0, to mean "not set"."""
    from lit_rlhf.launch.memory_plan import plan_settings
    from lit_rlhf.launch.runner import memory_plan

    cfg = compose(
        [
            "model=llama7b",
            "algo=ppo_max",
            "algo.reward_path=/ckpt/rm",
            "trainer.accelerator=gpu",
            "trainer.devices=1",
            f"memory_plan.gpu_memory_gb={value}",
        ],
        tmp_path,
    )
    with pytest.raises(ConfigError, match=message):
        plan_settings(cfg)
    with pytest.raises(ConfigError, match=message):
        memory_plan(cfg)  # what --plan prints


def test_a_bad_memory_plan_value_is_refused_by_the_plan_and_by_a_gpu_launch(tmp_path):
    from lit_rlhf.launch.runner import check_memory_plan

    cfg = compose(
        [
            "model=llama7b",
            "algo=ppo_max",
            "algo.reward_path=/ckpt/rm",
            "trainer.accelerator=gpu",
            "trainer.devices=1",
            "memory_plan.gpu_memory_gb=-1",
        ],
        tmp_path,
    )
    with pytest.raises(ConfigError, match="memory_plan.gpu_memory_gb: must be > 0"):
        check_memory_plan(cfg, plan(cfg))  # a GPU launch
    cpu = compose(["memory_plan.reserve_gb=-1"], tmp_path)
    with pytest.raises(ConfigError, match="memory_plan.reserve_gb: must be >= 0"):
        plan(cpu)  # validated before anything is built, on CPU too
