"""Model specs and builders: cheap picklable specs, weights built late (in ``configure_model``);
tokenizers: lit_rlhf/data/tokenizers.py."""

from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

__all__ = [
    "ModelSpec",
    "TinyLlamaConfig",
    "build_causal_lm",
    "freeze",
    "RewardModel",
    "build_reward_model",
    "load_reward_model",
]

_LAZY = {
    "build_causal_lm": "builders",
    "freeze": "builders",
    "RewardModel": "reward",
    "build_reward_model": "reward",
    "load_reward_model": "reward",
}


def __getattr__(name: str):
    # builders import transformers; keep `import lit_rlhf.models` light until they are used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lit_rlhf.models.{_LAZY[name]}"), name)
    raise AttributeError(name)
