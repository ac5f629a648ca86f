"""Model specs and builders: cheap picklable specs, weights built late (in ``configure_model``);
tokenizers: lit_rlhf/data/tokenizers.py."""

from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig
from lit_rlhf.utils.lazy import lazy_names

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


# builders import transformers; keep `import lit_rlhf.models` light until they are used
__getattr__ = lazy_names(__name__, _LAZY)
