"""Every option of every config group composes; the cheap parts instantiate; validation runs."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lit_rlhf.runner import _resolve_auto_monitor, plan
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_strategy
from tests.conftest import ROOT, compose

CONF = ROOT / "conf"
GROUPS = ["model", "algo", "data", "strategy", "trainer", "logger", "callbacks", "experiment", "hparams_search", "debug"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# options that need user-supplied values: the first key is `???` (visibly missing) in the config
NEEDS_USER_VALUE = {
    ("data", "sft_file"): ["data.sft.source=x.jsonl"],
    **{("algo", a): ["algo.policy_path=/models/sft", "algo.reward_path=/models/rm"]
       for a in ("ppo", "ppo_max", "ppo_moss_release")},
    ("experiment", "ppo_max_hh_llama7b"): ["algo.policy_path=/models/sft", "algo.reward_path=/models/rm"],
    ("experiment", "ppo_max_synthetic_tiny"): ["algo.policy_path=/models/sft"],
}  # fmt: skip


def test_every_group_has_options():
    for g in GROUPS:
        assert list((CONF / g).glob("*.yaml")), f"conf/{g} is empty"


# an algo that can consume each data kind (data options without an `sft` section use these)
ALGO_FOR_KIND = {"preference": ["algo=rm"], "prompt": ["algo=ppo", *NEEDS_USER_VALUE[("algo", "ppo")]]}


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_validates(group, option, tmp_path):
    cfg = compose([f"{group}={option}"], tmp_path)
    if group == "data" and "sft" not in cfg.data:
        kind = next(k for k in ALGO_FOR_KIND if k in cfg.data)
        cfg = compose([f"{group}={option}", *ALGO_FOR_KIND[kind]], tmp_path)
    assert OmegaConf.to_yaml(cfg)
    if (group, option) in NEEDS_USER_VALUE:
        values = NEEDS_USER_VALUE[(group, option)]
        key = values[0].split("=")[0]
        parent, leaf = key.rsplit(".", 1)
        assert OmegaConf.is_missing(OmegaConf.select(cfg, parent), leaf)
        with pytest.raises(ConfigError, match=rf"{key}: is required"):
            plan(cfg)
        cfg = compose([f"{group}={option}", *values], tmp_path)
    p = plan(cfg)  # model, algo and data configs are typed and valid
    if getattr(p.algo_cls, "is_pipeline", False):  # algo=demo: its stages are validated when they run
        assert p.algo.stages == ["sft", "rm", "ppo", "ppo_max"]
        return
    assert p.algo_cls.data_kind in cfg.data
    if group == "strategy":
        strategy = instantiate_strategy(cfg.strategy)
        assert strategy == "auto" if option == "auto" else type(strategy).__name__.endswith("Strategy")
    if group == "logger":
        loggers = instantiate_loggers(cfg.logger)
        assert len(loggers) == (0 if option == "none" else 1)
    if group == "callbacks":
        callbacks = instantiate_callbacks(_resolve_auto_monitor(cfg.callbacks, p.algo_cls))
        expected = {"none": set(), "default": {"ModelCheckpoint"},
                    "rlhf": {"ModelCheckpoint", "KLMonitor", "PerplexityMonitor", "ResponseLengthMonitor",
                             "RewardStatsMonitor", "SamplesTable", "CollapseAlarm", "StabilityReport", "WandbPanels"}}  # fmt: skip
        assert {type(c).__name__ for c in callbacks} == expected[option]
        names = [type(c).__name__ for c in callbacks]
        if option == "rlhf":  # the alarm reads what the monitors logged in the same iteration
            assert names.index("CollapseAlarm") > max(names.index(m) for m in ("KLMonitor", "ResponseLengthMonitor"))


def test_deepspeed_stage_2_settings(tmp_path):
    cfg = compose(["model=llama7b", "algo=sft", "strategy=deepspeed_stage_2"], tmp_path)
    ds = cfg.strategy.config
    assert ds.zero_optimization.stage == 2 and ds.bf16.enabled and ds.gradient_clipping == 1.0
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    assert cfg.model.name_or_path == "NousResearch/Llama-2-7b-hf" and cfg.model.trust_remote_code is False
    off = compose(["strategy=deepspeed_stage_2_offload"], tmp_path)
    assert off.strategy.config.zero_optimization.offload_optimizer.device == "cpu"
    assert off.algo.optimizer == "cpu_adam"
    assert compose(["strategy=deepspeed_stage_3"], tmp_path).strategy.config.zero_optimization.stage == 3


def test_aliases_match_their_targets(tmp_path):
    a, b = compose(["model=tiny"], tmp_path), compose(["model=tiny_llama"], tmp_path)
    assert a.model == b.model
    a, b = compose(["data=embedded"], tmp_path), compose(["data=synthetic"], tmp_path)
    assert a.data == b.data


def test_typo_and_bad_values_fail_before_any_model_is_built(tmp_path, monkeypatch):
    import lit_rlhf.models.builders as builders
    from lit_rlhf.runner import run
    from lit_rlhf.utils.config import ConfigError

    def forbidden(*a, **k):
        raise AssertionError("a model/tokenizer was built before validation finished")

    monkeypatch.setattr(builders, "build_causal_lm", forbidden)
    monkeypatch.setattr(builders, "build_tokenizer", forbidden)
    cases = {
        "algo.lrr=0.1": r"algo\.lrr: unknown key for SFTConfig\. Did you mean 'lr'\?",
        "algo.lr=-1": r"algo\.lr: must be > 0\.0, got -1\.0",
        "algo.scheduler=step": r"algo\.scheduler: must be one of \['constant', 'linear', 'cosine'\]",
        "model.tiny.hidden_size=30": r"model\.tiny\.hidden_size: must be divisible",
        "data.sft.batch_size=0": r"data\.sft\.batch_size: must be >= 1, got 0",
        "data.sft.max_lenght=3": r"data\.sft\.max_lenght: unknown key .* Did you mean 'max_length'",
    }
    for override, pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            run(compose([f"+{override}" if "lrr" in override or "lenght" in override else override], tmp_path))


def test_algo_without_matching_data_section(tmp_path):
    from lit_rlhf.utils.config import ConfigError

    cfg = compose([], tmp_path)
    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg.data["sft"]
    with pytest.raises(ConfigError, match=r"data\.sft: the selected data config has no 'sft' section"):
        plan(cfg)


@pytest.mark.parametrize("algo, metric, mode", [("sft", "val/perplexity", "min"), ("rm", "val/accuracy", "max")])
def test_checkpoint_monitor_auto_follows_the_stage(algo, metric, mode, tmp_path):
    cfg = compose([f"algo={algo}"], tmp_path)
    callbacks = instantiate_callbacks(_resolve_auto_monitor(cfg.callbacks, plan(cfg).algo_cls))
    (ckpt,) = [c for c in callbacks if type(c).__name__ == "ModelCheckpoint"]
    assert (ckpt.monitor, ckpt.mode) == (metric, mode)
    assert cfg.callbacks.model_checkpoint.monitor == "auto"  # the composed config is left as written


def test_ppo_presets_follow_the_algorithms_table(tmp_path):
    """ALGORITHMS §3: ppo_max = ppo + switches; ppo_moss_release = what the released scripts run."""
    required = ["algo.policy_path=/m/sft", "algo.reward_path=/m/rm"]
    ppo = plan(compose(["algo=ppo", *required], tmp_path)).algo
    pmax = plan(compose(["algo=ppo_max", *required], tmp_path)).algo
    moss = plan(compose(["algo=ppo_moss_release", *required], tmp_path)).algo
    assert (ppo.score_norm, ppo.score_clip, ppo.kl_coef, ppo.whiten_advantages, ppo.lam) == ("none", None, 0.0, True, 0.95)
    assert (pmax.score_norm, pmax.score_clip, pmax.kl_coef, pmax.kl_estimator) == ("normalize", 5.0, 0.05, "k1")
    assert (pmax.whiten_advantages, pmax.lam, pmax.critic_warmup_steps > 0, pmax.warmup_ratio) == (False, 0.9, True, 0.1)
    assert (ppo.ptx_coef, pmax.ptx_coef > 0, ppo.adaptive_kl, pmax.adaptive_kl) == (0.0, True, False, False)  # ptx: on with a set
    assert (moss.score_norm, moss.kl_coef, moss.lam, moss.ptx_coef, moss.critic_warmup_steps) == ("scale", 0.01, 0.95, 0.0, 0)
    for a in (ppo, pmax, moss):
        assert (a.clip_eps_low, a.clip_eps_high, a.value_clip, a.max_grad_norm, a.gamma) == (0.2, 0.2, 0.2, 1.0, 1.0)
        g = a.generation
        assert (g.temperature, g.top_p, g.repetition_penalty) == (0.8, 0.9, 1.1)


def test_llama7b_ppo_max_deepspeed_composes(tmp_path):
    cfg = compose(["model=llama7b", "algo=ppo_max", "strategy=deepspeed_stage_2",
                   "algo.policy_path=/ckpt/sft-7b", "algo.reward_path=/ckpt/rm-7b"], tmp_path)  # fmt: skip
    p = plan(cfg)
    # PPO trains algo.policy_path; model=llama7b contributes dtype and memory switches
    assert (p.model.name_or_path, p.model.dtype, p.model.gradient_checkpointing) == ("/ckpt/sft-7b", "bfloat16", True)
    assert cfg.strategy.config.zero_optimization.stage == 2 and cfg.trainer.precision == "bf16-mixed"
    assert type(instantiate_strategy(cfg.strategy)).__name__ == "DeepSpeedStrategy"
