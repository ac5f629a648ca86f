"""Every option of every config group composes; the cheap parts instantiate; validation runs."""

import dataclasses
import functools

import pytest
from omegaconf import OmegaConf

from lit_rlhf.launch.presets import CONF_DIR
from lit_rlhf.launch.runner import _resolve_auto_monitor, plan
from lit_rlhf.utils.config import ConfigError, to_dict
from lit_rlhf.utils.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_strategy
from tests.conftest import ROOT, compose

CONF = CONF_DIR
GROUPS = [
    "model",
    "algo",
    "pipeline",
    "data",
    "strategy",
    "trainer",
    "logger",
    "callbacks",
    "experiment",
    "hparams_search",
    "debug",
]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
RM = ["algo.reward_path=/models/rm"]
# options that need user-supplied values: the first key is `???` (visibly missing) in the config,
# or (RL presets) the reward, which the typed config requires
NEEDS_USER_VALUE = {
    ("data", "sft_file"): ["data.sft.source=x.jsonl"],
    ("data", "chat"): ["data.sft.source=x.jsonl"],
    ("model", "hf"): ["model.name_or_path=/models/qwen-instruct"],
    ("data", "qa_file"): ["data.prompt.source=x.jsonl", "algo=grpo", "algo.policy_path=/models/sft", *RM],
    **{("algo", a): ["algo.policy_path=/models/sft", *RM] for a in ("ppo", "ppo_max", "ppo_moss_release")},
    **{
        ("experiment", e): ["algo.policy_path=/models/sft", *RM]
        for e in ("ppo_synthetic_tiny", "ppo_max_synthetic_tiny")
    },
    **{("experiment", e): RM for e in ("ppo_max_llama7b_a100x8", "ppo_max_llama7b_lora_1gpu")},  # policy: model=llama7b
    **{("algo", a): ["algo.policy_path=/models/sft"] for a in ("dpo", "ipo", "cdpo", "simpo", "orpo", "kto")},
    **{
        ("experiment", e): ["algo.policy_path=/models/sft"]
        for e in (
            "dpo_synthetic_tiny",
            "dpo_hh_tiny",
            "dpo_hh_chat_tiny",
            "simpo_synthetic_tiny",
            "orpo_synthetic_tiny",
            "kto_synthetic_tiny",
        )
    },
    **{
        ("algo", a): ["algo.policy_path=/models/sft", *RM]
        for a in (
            "grpo",
            "dapo",
            "dr_grpo",
            "rloo",
            "reinforce_pp",
            "reinforce_pp_baseline",
            "remax",
            "gspo",
            "cispo",
            "gmpo",
        )
    },
    **{
        ("experiment", e): ["algo.policy_path=/models/sft", *RM]
        for e in (
            "grpo_synthetic_tiny",
            "dapo_synthetic_tiny",
            "reinforce_pp_synthetic_tiny",
            "remax_synthetic_tiny",
            "reinforce_pp_baseline_synthetic_tiny",
        )
    },
    **{
        ("experiment", e): ["algo.policy_path=/models/sft"]
        for e in (
            "grpo_reasoning_tiny",
            "dapo_reasoning_tiny",
            "dr_grpo_reasoning_tiny",
            "grpo_agent_tiny",
            "grpo_guess_tiny",
        )
    },
    ("experiment", "rm_hh_tiny"): ["model.name_or_path=/models/sft"],
    ("experiment", "rm_hh_chat_tiny"): ["model.name_or_path=/models/sft"],
}
# an algo that can consume each data kind (data options without an `sft` section use these)
ALGO_FOR_KIND = {"preference": ["algo=rm"], "prompt": ["algo=ppo", "algo.policy_path=/models/sft", *RM]}


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
        # the first value left out: its key is named (the reward of an RL stage: reward_path or reward_fn)
        message = {
            "algo.reward_path": r"algo.reward_path: set exactly one of algo.reward_path",
            "model.name_or_path": r"model.name_or_path: set exactly one of",
        }.get(key, rf"{key}: is required")
        with pytest.raises(ConfigError, match=message):
            plan(compose([f"{group}={option}", *values[1:]], tmp_path))
        cfg = compose([f"{group}={option}", *values], tmp_path)
    p = plan(cfg)  # model, algo and data configs are typed and valid
    if p.pipeline_cls is not None:  # a pipeline: every job it runs composes into a valid stage job
        expected = {
            "demo": ["sft", "rm", "ppo", "ppo_max", "dpo", "grpo", "dapo"],
            "zoo": [
                "sft",
                "rm",
                "dpo",
                "simpo",
                "orpo",
                "kto",
                "grpo",
                "reinforce_pp",
                "reinforce_pp_baseline",
                "remax",
            ],
            "reasoning": ["sft", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "gmpo"],
            "agent": ["sft", "grpo", "grpo_cost", "sft_plain", "grpo_plain", "sft_guess", "grpo_guess"],
        }
        assert p.pipeline.stages == expected[option]
        pipe = p.pipeline_cls(p.pipeline)
        for stage in p.pipeline.stages:
            job = plan(pipe.compose_stage(pipe.stage_overrides(stage, str(tmp_path), [])))
            assert job.algo_cls is not None and job.algo.export_dir.startswith(str(tmp_path / stage)), stage
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
        expected = {
            "none": set(),
            "default": {"ModelCheckpoint"},
            "rlhf": {
                "ModelCheckpoint",
                "KLMonitor",
                "PerplexityMonitor",
                "ResponseLengthMonitor",
                "RewardStatsMonitor",
                "SamplesTable",
                "CollapseAlarm",
                "StabilityReport",
                "WandbPanels",
            },
        }
        assert {type(c).__name__ for c in callbacks} == expected[option]
        names = [type(c).__name__ for c in callbacks]
        if option == "rlhf":  # the alarm reads what the monitors logged in the same iteration
            assert names.index("CollapseAlarm") > max(names.index(m) for m in ("KLMonitor", "ResponseLengthMonitor"))


@pytest.mark.parametrize("option", [o for g, o in OPTIONS if g == "strategy" and o.startswith("deepspeed")])
def test_deepspeed_options_agree_with_their_name_the_trainer_and_the_stage(option, tmp_path):
    """A DeepSpeed option builds lit_rlhf's DeepSpeed strategy at the ZeRO stage its name says; its bf16
    switch follows the trainer's precision; its global grad-norm clip (which replaces the stage's own
    under DeepSpeed, docs/algorithms.md §2.6) is ``algo.max_grad_norm``, so choosing a strategy does not
    change the clip; an offloaded optimizer comes with DeepSpeed's CPU Adam, the only optimizer that
    steps offloaded states, and only then."""
    cfg = compose(["model=llama7b", "algo=ppo_max", f"strategy={option}", *RM], tmp_path)
    ds, algo = cfg.strategy.config, plan(cfg).algo
    assert type(instantiate_strategy(cfg.strategy)).__name__ == "RLHFDeepSpeedStrategy"
    assert ds.zero_optimization.stage == int(option.split("_")[2])
    assert ds.bf16.enabled == str(cfg.trainer.precision).startswith("bf16") and cfg.trainer.accelerator == "gpu"
    assert ds.gradient_clipping == algo.max_grad_norm
    assert (algo.optimizer == "cpu_adam") == ("offload_optimizer" in ds.zero_optimization)


def test_aliases_match_their_targets(tmp_path):
    a, b = compose(["model=tiny"], tmp_path), compose(["model=tiny_llama"], tmp_path)
    assert a.model == b.model
    a, b = compose(["data=embedded"], tmp_path), compose(["data=synthetic"], tmp_path)
    assert a.data == b.data


def test_typo_and_bad_values_fail_before_any_model_is_built(tmp_path, monkeypatch):
    import lit_rlhf.data.tokenizers as tokenizers
    import lit_rlhf.models.builders as builders
    from lit_rlhf.launch.runner import run
    from lit_rlhf.utils.config import ConfigError

    def forbidden(*a, **k):
        raise AssertionError("a model/tokenizer was built before validation finished")

    monkeypatch.setattr(builders, "build_causal_lm", forbidden)
    monkeypatch.setattr(tokenizers, "build_tokenizer", forbidden)
    cases = {
        "algo.lrr=0.1": r"algo\.lrr: unknown key for SFTConfig\. Did you mean 'lr'\?",
        "algo.lr=-1": r"algo\.lr: must be > 0\.0, got -1\.0",
        "algo.scheduler=step": r"algo\.scheduler: must be one of \['constant', 'linear', 'cosine', 'inverse_sqrt'\]",
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


def _presets_table() -> dict[str, dict[str, object]]:
    """docs/algorithms.md §3's table as {preset: {dotted algo key: value}}: a cell's values pair with
    its row's backticked keys in order ("a / b", "a (b, c)", "a : b, c"; "`x` = `y`" share a value;
    "same" = the first preset's column; "`generation`: new tokens, T …" names generation's keys)."""
    import re

    import yaml

    text = (ROOT / "docs" / "algorithms.md").read_text()
    rows = [
        line for line in text[text.index("## 3. Presets") : text.index("## 4.")].splitlines() if line.startswith("| ")
    ]
    presets = re.findall(r"`algo=(\w+)`", rows[0])
    split = re.compile(r"\s*[/,:()]\s*")
    words = {"new tokens": "max_new_tokens", "T": "temperature", "top-p": "top_p", "rep. penalty": "repetition_penalty"}

    def value(token: str) -> object:
        v = yaml.safe_load(token)
        try:
            return float(v) if isinstance(v, str) else v  # YAML 1.1 reads 5e-7 as a string
        except ValueError:
            return v

    table: dict[str, dict[str, object]] = {p: {} for p in presets}
    for row in rows[1:]:  # after the header (the |---| line is not a "| " row)
        cells = [c.strip() for c in row.strip("|").split("|")]
        prefix = re.match(r"`(\w+)`:\s*(.*)", cells[0])
        segments = split.split(prefix.group(2)) if prefix else [x for x in split.split(cells[0]) if x]
        keys = [[f"{prefix.group(1)}.{words[x]}"] if prefix else re.findall(r"`(\w+)`", x) for x in segments]
        for preset, cell in zip(presets, cells[1:]):
            cell = cells[1] if cell == "same" else cell
            for names, token in zip(keys, [x for x in split.split(cell) if x]):
                table[preset].update({name: value(token) for name in names})  # names [] = no config key (critic init)
    return table


def test_ppo_presets_follow_the_algorithms_table(tmp_path):
    """docs/algorithms.md §3 is what the presets compose to: every value of its table, for each of
    ppo, ppo_max and ppo_moss_release, is the typed config's (with the 7B model of its headline command)."""
    table = _presets_table()
    assert set(table) == {"ppo", "ppo_max", "ppo_moss_release"} and all(len(v) >= 20 for v in table.values())
    for preset, values in table.items():
        algo = to_dict(plan(compose([f"algo={preset}", "model=llama7b", *RM], tmp_path)).algo)
        typed = {key: functools.reduce(dict.__getitem__, key.split("."), algo) for key in values}
        assert typed == values, preset


def test_headline_7b_command_composes_the_7b_recipe(tmp_path):
    """`python train.py model=llama7b algo=ppo_max strategy=deepspeed_stage_2 algo.reward_path=…` is the
    whole command: the policy is the model group's model (the preset's values are checked against
    docs/algorithms.md above), the prompt loader's batch is the rollout batch, the strategy builds."""
    cfg = compose(["model=llama7b", "algo=ppo_max", "strategy=deepspeed_stage_2", *RM], tmp_path)
    p = plan(cfg)  # no algo.policy_path
    assert p.algo.policy_path is None and p.model.name_or_path == cfg.model.name_or_path
    assert p.data.batch_size == p.algo.rollout_batch_size  # the prompt loader's batch IS the rollout batch
    assert type(instantiate_strategy(cfg.strategy)).__name__ == "RLHFDeepSpeedStrategy"  # a Lightning DeepSpeedStrategy
    # an SFT export instead of the base model: the same recipe, trained from that folder with the model group's settings
    p2 = plan(compose(["model=llama7b", "algo=ppo_max", "algo.policy_path=/ckpt/sft-7b", *RM], tmp_path))
    assert p2.model.name_or_path == "/ckpt/sft-7b" and p2.algo == dataclasses.replace(
        p.algo, policy_path="/ckpt/sft-7b"
    )
    assert (p2.model.dtype, p2.model.gradient_checkpointing) == (cfg.model.dtype, cfg.model.gradient_checkpointing)


@pytest.mark.parametrize("algo", ["ppo_max", "grpo", "dpo"])
def test_headline_commands_compose_a_real_job(algo, tmp_path):
    """`model=llama7b algo=…` composes HH-RLHF prompts in the model's chat form (template=auto), the
    lengths of a 4k-context model, bf16 mixed precision on a GPU, not the embedded toy task."""
    extra = [] if algo == "dpo" else RM
    p = plan(compose(["model=llama7b", f"algo={algo}", *extra], tmp_path))
    cfg = compose(["model=llama7b", f"algo={algo}", *extra], tmp_path)
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("gpu", "bf16-mixed")
    assert p.data.template == "auto" and p.data.source == "Anthropic/hh-rlhf" and p.data.hub_data_dir == "harmless-base"
    assert p.data.train_rows == "1-2000"
    if algo == "dpo":
        assert p.data.max_length == 1024
    else:
        assert p.data.max_prompt_length == 512 and p.algo.generation.max_new_tokens == 256
    # the user's own choice still wins
    assert (
        compose(["model=llama7b", f"algo={algo}", "data=chat", "trainer=cpu"], tmp_path).data.prompt.template == "auto"
    )


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict) and node:
        return {k: v for key, sub in node.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


TINY = sorted(p.stem for p in (CONF / "experiment").glob("*_synthetic_tiny.yaml"))


@pytest.mark.parametrize("experiment", TINY)
def test_tiny_experiments_carry_the_demo_values(experiment, tmp_path):
    """The tiny model's values live in its experiments (the demo composes them), not in the presets:
    each algo value an experiment (or its parent) sets is the typed config's and differs from the
    preset's, every other algo value is the preset's, and an RL stage's prompt batch is its rollout batch."""
    from hydra.core.hydra_config import HydraConfig

    own, name = {}, experiment
    while name:  # the experiment's algo keys over its parents'
        node = _load("experiment", name)
        own = _merge(dict(node.get("algo", {})), own)
        name = next((e for e in node.get("defaults", []) if isinstance(e, str) and e != "_self_"), None)
    needs = NEEDS_USER_VALUE.get(("experiment", experiment), [])
    p = plan(compose([f"experiment={experiment}", *needs], tmp_path))
    preset = plan(compose([f"algo={HydraConfig.get().runtime.choices.algo}", *needs], tmp_path)).algo
    typed, base, set_here = _flat(to_dict(p.algo)), _flat(to_dict(preset)), _flat(own)
    for key, value in set_here.items():
        if isinstance(value, str) and value.startswith("${"):  # an interpolation: resolved, e.g. the task's config
            assert any(k.startswith(f"{key}.") for k in typed), key
            continue
        assert typed[key] == value and base.get(key) != value, key
    changed = {k for k in typed if typed[k] != base.get(k)}
    assert changed and all(any(k == s or k.startswith(f"{s}.") for s in set_here) for k in changed), changed
    if hasattr(p.algo, "rollout_batch_size"):
        assert p.data.batch_size * getattr(p.algo, "num_generations", 1) == p.algo.rollout_batch_size


def _load(group: str, name: str) -> dict:
    return OmegaConf.to_container(
        OmegaConf.load(CONF / group / f"{name}.yaml")
    )  # Hydra's YAML parsing (1e-5 is a float)


def _merge(base: dict, top: dict) -> dict:
    for key, value in top.items():
        base[key] = (
            _merge(dict(base[key]), value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        )
    return base


def _schema_defaults(name: str) -> dict:
    from lit_rlhf.launch.schemas import schema_class

    return to_dict(schema_class(name)())


def _group_file(group: str, name: str) -> tuple[dict, dict, set[str]]:
    """(what lit_rlhf/conf/<group>/<name>.yaml composes to from its defaults list alone, its own keys, the
    typed packages): ``/schema/<s>@<package>`` entries give a dataclass's defaults at that package
    (``_here_``: the whole file), a plain entry is a parent in the same group, composed first."""
    node = _load(group, name)
    base, typed = {}, set()
    for entry in node.pop("defaults", []):
        if isinstance(entry, str) and entry.startswith("/schema/"):
            schema, _, package = entry.removeprefix("/schema/").partition("@")
            package = "" if package in ("", "_here_") else package
            base = _merge(base, {package: _schema_defaults(schema)} if package else _schema_defaults(schema))
            typed.add(package)
        elif isinstance(entry, str) and entry != "_self_":
            parent_base, parent_own, parent_typed = _group_file(group, entry)
            base, typed = _merge(_merge(base, parent_base), parent_own), typed | parent_typed
    return base, node, typed


@functools.cache
def _free_mappings() -> frozenset[str]:
    """Names of the typed configs' free-form mapping fields (a ``dict`` defaulting to ``{}``, e.g. the
    pipeline's ``jobs``): their keys are the user's, not config fields."""
    from lit_rlhf.launch.schemas import SCHEMAS

    return frozenset(k for name in SCHEMAS for k, v in _schema_defaults(name).items() if v == {})


def _restated(own: dict, base: dict, path: str, typed: bool, typed_packages: set[str]) -> list[str]:
    """Keys of ``own`` whose value is what ``base`` already gives (recursing into mappings). Under a
    typed package a key the dataclass lacks is reported too (not inside a free-form mapping field)."""
    found = []
    for key, value in own.items():
        full = f"{path}.{key}" if path else key
        if key == "_target_":
            continue
        in_type = (typed or full in typed_packages) and not (path and path.rsplit(".", 1)[-1] in _free_mappings())
        if key not in base:
            if in_type:
                found.append(f"{full} is not a config field")
            continue
        if isinstance(value, dict) and isinstance(base[key], dict):
            found += _restated(value, base[key], full, in_type, typed_packages)
        elif value == base[key]:
            found.append(f"{full}={value!r}")
    return found


TYPED_FILES = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml")) if _group_file(g, p.stem)[2]]


def test_every_typed_config_is_reached_by_the_restatement_check():
    """Each registered schema is the start of some config file (so its files are in TYPED_FILES), and
    every file of a group with typed files is either typed or an alias (a parent and no keys)."""
    from lit_rlhf.launch.schemas import SCHEMAS

    used = {
        e.removeprefix("/schema/").partition("@")[0]
        for g in GROUPS
        for p in (CONF / g).glob("*.yaml")
        for e in _load(g, p.stem).get("defaults", [])
        if isinstance(e, str) and e.startswith("/schema/")
    }
    assert used == set(SCHEMAS)
    for group in {g for g, _ in TYPED_FILES}:
        for path in (CONF / group).glob("*.yaml"):
            base, own, typed = _group_file(group, path.stem)
            assert typed or (base and not own), f"{group}/{path.name}: neither typed nor an alias"


@pytest.mark.parametrize("group, name", TYPED_FILES, ids=[f"{g}={n}" for g, n in TYPED_FILES])
def test_configs_list_only_what_differs_from_the_typed_defaults(group, name):
    """A value equal to its dataclass default (or to the parent preset's) would be a second "default"
    of that key: presets, model and data files and the pipeline list only what differs (a comment may
    document a default)."""
    base, own, typed = _group_file(group, name)
    found = _restated(own, base, "", "" in typed, typed)
    assert not found, f"{group}/{name}.yaml repeats its defaults: {found}"


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiments_set_only_what_their_presets_do_not(name):
    """An experiment's algo/model/data value equal to what its chosen presets (or its parent
    experiment) already compose to is a restatement, not a recipe value."""
    chosen = {next(iter(e)): e[next(iter(e))] for e in _load("", "train")["defaults"] if isinstance(e, dict)}

    def compose_experiment(exp: str) -> tuple[dict, dict, dict]:  # (choices, what they compose to, own keys)
        node = _load("experiment", exp)
        choices, body = dict(chosen), {}
        for entry in node.pop("defaults", []):
            if isinstance(entry, str) and entry != "_self_":  # a parent experiment
                choices, parent_base, parent_own = compose_experiment(entry)
                body = _merge(body, parent_own)
            elif isinstance(entry, dict):
                ((key, value),) = entry.items()
                choices[key.removeprefix("override /")] = value
        groups = {g: _group_file(g, choices[g]) for g in ("algo", "model", "data") if choices.get(g)}
        base = {g: _merge(_merge(b, own), body.get(g, {})) for g, (b, own, _) in groups.items()}
        return choices, base, node

    _, base, own = compose_experiment(name)
    found = [
        r for g in ("algo", "model", "data") if g in own for r in _restated(own[g], base.get(g, {}), g, False, set())
    ]
    assert not found, f"experiment/{name}.yaml repeats what its presets give: {found}"


@pytest.mark.parametrize("section", ["sft", "preference", "prompt"])
def test_data_sections_share_the_template_and_row_range_checks(section):
    """The checks of the data configs' common base (``DataConfig.validate``) run for every section:
    an unknown template and each row-range key that does not parse fail naming the section's key."""
    from lit_rlhf.launch.schemas import schema_class
    from lit_rlhf.utils.config import build_config

    cls = schema_class(f"{section}_data")
    build_config(cls, {"train_rows": "1-10", "template": "dialogue"}, f"data.{section}")  # valid: builds
    with pytest.raises(ConfigError, match=rf"data\.{section}\.template: must be one of \["):
        build_config(cls, {"template": "chatml-typo"}, f"data.{section}")
    assert "train_rows" in cls.ROW_KEYS and set(cls.ROW_KEYS) == {k for k in to_dict(cls()) if k.endswith("_rows")}
    for key in cls.ROW_KEYS:
        with pytest.raises(ConfigError, match=rf"data\.{section}\.{key}: expected a row range"):
            build_config(cls, {key: "first"}, f"data.{section}")


def test_rollout_batch_is_one_key(tmp_path):
    ppo = ["algo=ppo", "algo.policy_path=/m/sft", *RM]
    with pytest.raises(
        ConfigError,
        match=r"data.prompt.batch_size: the rollout batch of an RL stage is "
        r"algo.rollout_batch_size \(32 responses, 32 prompts\)",
    ):
        plan(compose([*ppo, "data.prompt.batch_size=8"], tmp_path))
    assert plan(compose([*ppo, "algo.rollout_batch_size=8"], tmp_path)).data.batch_size == 8


def test_rl_from_an_untrained_tiny_model_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"algo.policy_path: is required here: the model group builds an untrained tiny"
    ):
        plan(compose(["algo=ppo", *RM], tmp_path))


def test_lora_under_fsdp_is_refused_before_anything_is_built(tmp_path):
    """The adapters-off reference would bypass the FSDP units: a config error naming the key."""
    with pytest.raises(ConfigError, match="strategy: model.lora.enabled=true with strategy=fsdp"):
        plan(
            compose(["algo=ppo", "strategy=fsdp", "model.lora.enabled=true", "algo.policy_path=/m/sft", *RM], tmp_path)
        )
    plan(
        compose(["algo=ppo", "strategy=fsdp", "algo.policy_path=/m/sft", *RM], tmp_path)
    )  # full fine-tuning under FSDP: fine


def test_readme_own_model_and_data_commands_compose(tmp_path):
    """The five commands of README "Your own model and data" compose into valid stage jobs with the
    chat template in every data section they read."""
    import shlex

    text = (ROOT / "README.md").read_text()
    block = text.split("## Your own model and data", 1)[1].split("```", 2)[1]
    commands = [" ".join(c.split()) for c in block.replace("\\\n", " ").splitlines() if "python train.py" in c]
    assert len(commands) == 4
    for command in commands:
        args = [a for a in shlex.split(command.split("#")[0])[2:] if not a.startswith("hydra.")]
        p = plan(compose(args, tmp_path))
        assert p.data.template == "auto" and p.model.dtype == "bfloat16", command
