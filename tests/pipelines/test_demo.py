"""The main job, shortened: every stage runs through train.py's code path, the summary and PNG appear."""

import json

import pytest
from omegaconf import OmegaConf, open_dict

from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.launch.runner import run
from tests.conftest import compose

TINY = [
    "pipeline=demo",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "logger=csv",
    "model.tiny.hidden_size=32",
    "model.tiny.num_attention_heads=2",
    "model.tiny.intermediate_size=64",
]
BUDGET = [
    "data.sft.n_train=256",
    "data.sft.n_val=32",
    "trainer.max_epochs=1",
    "data.preference.n_train=256",
    "data.preference.n_val=32",
    "data.preference.n_test=32",
    "data.prompt.n_val=16",
    "data.prompt.eval_batch_size=16",
]


def shorten(stage_overrides, steps=8):
    """The stage's own overrides, then 2 RL iterations (PPO: 4 optimizer steps each) validated after each."""
    return [
        *OmegaConf.to_container(stage_overrides, resolve=False),
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=1",
    ]


@pytest.mark.slow
@pytest.mark.integration
def test_shortened_demo_pipeline(tmp_path):
    cfg = compose(TINY, tmp_path)
    assert cfg.pipeline._target_ == "lit_rlhf.pipelines.demo.DemoPipeline" and "algo" not in cfg
    with open_dict(cfg):
        cfg.pipeline.common = BUDGET
        jobs = cfg.pipeline.jobs
        jobs.ppo, jobs.ppo_max = shorten(jobs.ppo), shorten(jobs.ppo_max)
        jobs.grpo, jobs.dapo = shorten(jobs.grpo, steps=2), shorten(jobs.dapo, steps=2)
        cfg.pipeline.eval_prompts = 24
    metrics = run(cfg)
    for stage, export in (
        ("sft", "policy"),
        ("rm", "reward_model"),
        ("ppo", "actor"),
        ("ppo_max", "actor"),
        ("dpo", "policy"),
        ("grpo", "actor"),
        ("dapo", "actor"),
    ):
        assert (tmp_path / stage / export).is_dir(), stage
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"SFT", "PPO (β=0)", "PPO-max", "DPO", "GRPO", "DAPO"}
    for res in summary["policies"].values():
        assert set(res) == {
            "gold_mean",
            "gold_std",
            "proxy_mean",
            "kl_to_sft",
            "perplexity",
            "response_length",
            "truncation_rate",
        }
    assert summary["policies"]["SFT"]["kl_to_sft"] == pytest.approx(0.0, abs=1e-5)  # the reference itself
    assert len(summary["curves"]["ppo"]["gold"]) == 3  # before fit + after each of 2 iterations
    assert {
        "ppo_overoptimized",
        "ppo_kl_drift",
        "ppo_length_drift",
        "ppo_max_kl_bounded",
        "dpo_gold_gain_in_sft_sigma",
        "grpo_overoptimized",
        "dapo_kl_bounded",
    } <= set(summary["checks"])
    assert (tmp_path / "dpo" / "csv" / "metrics.csv").exists() and "dpo/val/rewards/accuracies" in metrics
    table = (tmp_path / "summary.md").read_text()
    assert (
        "| PPO-max |" in table and "| DPO |" in table and "| DAPO |" in table and "PPO (β=0) drift: KL to SFT" in table
    )
    assert "DPO vs SFT: gold" in table and "GRPO vs SFT: gold" in table and "during training gold peaked" in table
    assert (tmp_path / "stability.png").stat().st_size > 20_000
    assert "eval/PPO-max/gold_mean" in metrics and "ppo_max/critic/loss" in metrics
    # rerunning the pipeline reuses the finished stages (only the evaluation runs again)
    again = run(cfg)
    assert not any(k.startswith(("sft/", "ppo/", "dpo/")) for k in again) and "eval/SFT/gold_mean" in again


def test_plain_train_py_is_the_pipeline(tmp_path):
    """`python train.py` with no arguments selects the demo pipeline (lit_rlhf/conf/train.yaml default)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train")
    assert cfg.pipeline._target_ == "lit_rlhf.pipelines.demo.DemoPipeline" and "algo" not in cfg
    assert cfg.pipeline.stages == ["sft", "rm", "ppo", "ppo_max", "dpo", "grpo", "dapo"]


def test_final_table_samples_with_the_rl_stages_settings(tmp_path):
    """The evaluation reads generation, template and prompt length from the RL stage as composed
    for the run (here changed through the stage's overrides), not from constants."""
    from lit_rlhf.launch.runner import plan
    from lit_rlhf.pipelines.demo import DemoPipeline

    cfg = compose(["pipeline=demo"], tmp_path)
    with open_dict(cfg):
        cfg.pipeline.jobs.ppo_max = [
            *OmegaConf.to_container(cfg.pipeline.jobs.ppo_max, resolve=False),
            "algo.generation.max_new_tokens=7",
            "data.prompt.max_prompt_length=9",
        ]
    gen, template, max_prompt_length = DemoPipeline(plan(cfg).pipeline).rollout_settings(str(tmp_path), cfg)
    assert (gen.max_new_tokens, gen.temperature, gen.top_p, template, max_prompt_length) == (7, 0.8, 0.9, "plain", 9)
