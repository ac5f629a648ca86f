"""Model specs and builders: cheap picklable specs, weights built late (in ``configure_model``)."""

from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

__all__ = ["ModelSpec", "TinyLlamaConfig", "build_causal_lm", "build_tokenizer", "freeze"]


def __getattr__(name: str):
    # builders import transformers; keep `import lit_rlhf.models` light until they are used
    if name in ("build_causal_lm", "build_tokenizer", "freeze"):
        from lit_rlhf.models import builders

        return getattr(builders, name)
    raise AttributeError(name)
