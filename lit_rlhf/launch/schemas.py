"""Every typed config's defaults as a Hydra schema, so YAML presets list only what differs.

``register()`` stores ``to_dict(Config())`` of each dataclass in Hydra's ConfigStore under the
group ``schema`` (``schema/ppo``, ``schema/prompt_data`` …). A preset (or a section of one:
``/schema/prompt_data@prompt``, ``/schema/tiny_llama@tiny``) starts from one:

    defaults:
      - /schema/ppo@_here_     # every PPOConfig field at its dataclass default
      - _self_
    _target_: lit_rlhf.modules.ppo.PPOModule

so the dataclass default is the ONE default of a key (docs/configs.md), ``--cfg job`` shows
every key, and ``algo.ppo_epochs=2`` works on the command line without ``+``. The nodes are
plain dicts (OmegaConf cannot type ``Literal`` or ``dict | None``); types, ranges and unknown
keys are checked by ``build_config`` when the job starts.

It also registers the ``lit_rlhf_job`` resolver that names a run's log folder
(``task_name``): the chosen stage (``algo``), else the pipeline. Call ``register()`` before
composing (train.py and tests/conftest.py do).
"""

from __future__ import annotations

import importlib

from lit_rlhf.utils.config import to_dict

SCHEMAS = {
    "sft": "lit_rlhf.modules.configs:SFTConfig",
    "rm": "lit_rlhf.modules.configs:RMConfig",
    "ppo": "lit_rlhf.modules.configs:PPOConfig",
    "dpo": "lit_rlhf.modules.configs:DPOConfig",
    "grpo": "lit_rlhf.modules.configs:CriticFreeConfig",
    "pipeline": "lit_rlhf.pipelines.demo:DemoConfig",
    "reasoning_pipeline": "lit_rlhf.pipelines.reasoning:ReasoningConfig",
    "agent_pipeline": "lit_rlhf.pipelines.agent:AgentConfig",
    "model": "lit_rlhf.models.spec:ModelSpec",
    "tiny_llama": "lit_rlhf.models.spec:TinyLlamaConfig",  # model.tiny of lit_rlhf/conf/model/tiny_llama.yaml
    "sft_data": "lit_rlhf.data.configs:SFTDataConfig",
    "preference_data": "lit_rlhf.data.configs:PreferenceDataConfig",
    "prompt_data": "lit_rlhf.data.configs:PromptDataConfig",
    "task": "lit_rlhf.data.synthetic:TaskConfig",  # data.task of lit_rlhf/conf/data/synthetic.yaml (the embedded task)
    "reasoning_task": "lit_rlhf.data.reasoning:ReasoningTaskConfig",  # data.reasoning of conf/data/reasoning.yaml
}
# the stages' modules and their typed configs' schemas: an unknown algo.* key is reported with
# its config class without importing the stage (torch, Lightning); a test checks it against each
# module's ``config_class``
STAGE_SCHEMAS = {
    "lit_rlhf.modules.sft.SFTModule": "sft",
    "lit_rlhf.modules.reward_model.RewardModelModule": "rm",
    "lit_rlhf.modules.ppo.PPOModule": "ppo",
    "lit_rlhf.modules.dpo.DPOModule": "dpo",
    "lit_rlhf.modules.critic_free.CriticFreeModule": "grpo",
}
# and, by schema, the data section each reads (its ``data_kind``): runner.check_before_imports lists a job's
# missing inputs and checks its algo.* values before torch and Lightning are imported
STAGE_DATA_KINDS = {"sft": "sft", "rm": "preference", "ppo": "prompt", "dpo": "preference", "grpo": "prompt"}
_registered = False


def schema_class(name: str) -> type:
    module, cls = SCHEMAS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def job_name(algo: str | None, pipeline: str | None) -> str:
    """``task_name`` of a run: the stage (``algo`` choice), else the pipeline (e.g. "demo")."""
    return algo if algo not in (None, "None") else (pipeline if pipeline not in (None, "None") else "run")


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("lit_rlhf_job", job_name, replace=True)
    store = ConfigStore.instance()
    for name in SCHEMAS:
        store.store(group="schema", name=name, node=to_dict(schema_class(name)()))
    _registered = True
