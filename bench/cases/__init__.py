"""The benchmark cases (bench/run.py runs each in its own process), one module per family:
generation (``generation.py``), PPO with its naive floor and its memory cases (``ppo.py``), the
reward model (``rm.py``), DPO (``dpo.py``), the vLLM rollout engine (``engine.py``), GRPO — also
both trainers in one process, steps
alternating: :class:`Alternation` (``grpo.py``, ``alternation.py``), answer extraction on degenerate
responses (``extraction.py``), GRPO with its reward model in-process and behind the reward server
(``remote.py``), multi-turn rollouts against single-turn ones (``agent.py``), asynchronous rollouts against
synchronous ones (``asynchronous.py``); shared set-up and timers in
``common.py``. Each case takes the models folder and the shapes and returns a dict of measurements."""

from __future__ import annotations

from .agent import case_multiturn
from .alternation import Alternation
from .asynchronous import case_async_rollouts
from .common import ROOT, build_models, peak_rss_mb, shapes
from .dpo import case_dpo_ours, case_dpo_trl
from .engine import case_generate_vllm, case_sync_engine
from .extraction import case_extraction
from .generation import case_generate_bare, case_generate_ours
from .grpo import case_grpo_ours, case_grpo_paired, case_grpo_trl
from .ppo import case_floor, case_ppo_memory, case_ppo_ours, case_ppo_trl
from .remote import case_reward_server
from .rm import case_rm_ours, case_rm_trl

CASES = {
    "generate_bare": case_generate_bare,
    "generate_ours": case_generate_ours,
    "generate_vllm": case_generate_vllm,
    "floor": case_floor,
    "ppo_ours": case_ppo_ours,
    "ppo_trl": case_ppo_trl,
    "ppo_vllm": lambda models, s: case_ppo_ours(models, s, engine="vllm"),
    "sync_engine": case_sync_engine,
    "rm_ours": case_rm_ours,
    "rm_trl": case_rm_trl,
    "dpo_ours": case_dpo_ours,
    "dpo_trl": case_dpo_trl,
    "dpo_ours_precomputed": lambda models, s: case_dpo_ours(models, s, precompute=True),
    "dpo_trl_precomputed": lambda models, s: case_dpo_trl(models, s, precompute=True),
    "grpo_ours": case_grpo_ours,
    "grpo_trl": case_grpo_trl,
    "grpo_paired": case_grpo_paired,
    "ppomem_full": lambda models, s: case_ppo_memory(models, s, lora=False),
    "ppomem_lora": lambda models, s: case_ppo_memory(models, s, lora=True),
    "extraction": case_extraction,
    "reward_server": case_reward_server,
    "multiturn": case_multiturn,
    "async_rollouts": case_async_rollouts,
}
TRL_CASES = {"ppo_trl", "rm_trl", "dpo_trl", "dpo_trl_precomputed", "grpo_trl", "grpo_paired"}

__all__ = ["CASES", "TRL_CASES", "ROOT", "Alternation", "build_models", "peak_rss_mb", "shapes"]
