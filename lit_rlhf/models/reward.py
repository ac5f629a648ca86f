"""``RewardModel``: a backbone (causal LM or encoder) + a scalar head; its on-disk format.

Saved folder (``save_pretrained``) = the backbone's own Hugging Face files (for a causal LM the
whole ``*ForCausalLM``, LM head included, so PPO can initialise a critic or reuse the trunk),
the tokenizer, plus:

* ``reward_head.safetensors`` — ``weight`` (1, H) and ``bias`` (1,);
* ``reward_config.json`` — ``{"format": "lit_rlhf.reward_model", "version": 1, "kind", "pooling", "hidden_size"}``.

:func:`load_reward_model` reads it back (``lit_rlhf.models.load_reward_model``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import Tensor, nn

from lit_rlhf.models.heads import Pooling, ScalarHead, pool

FORMAT = "lit_rlhf.reward_model"
HEAD_FILE = "reward_head.safetensors"
CONFIG_FILE = "reward_config.json"


class RewardModel(nn.Module):
    """Scores (B,) of token sequences: ``head(pool(trunk(input_ids)))``.

    Args:
        backbone: a ``*ForCausalLM`` (kind "causal_lm") or an encoder ``AutoModel`` ("encoder").
        kind: which of the two.
        pooling: "last" (last non-pad token; the default for causal LMs), "cls" or "mean".
    """

    def __init__(self, backbone: nn.Module, kind: str, pooling: Pooling, head_init_std: float | None = None):
        super().__init__()
        self.backbone = backbone
        self.kind = kind
        self.pooling = pooling
        self.padding_free = False  # a run-time switch, not saved
        self.head = ScalarHead(backbone.config.hidden_size, head_init_std)

    @property
    def trunk(self) -> nn.Module:
        """The transformer without any LM head (LlamaModel, BertModel, …)."""
        return self.backbone.base_model if self.kind == "causal_lm" else self.backbone

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, H) last-layer hidden states (after the final norm for Llama). A causal trunk
        runs padding-free when ``self.padding_free`` is set (zeros at padding; the stages set it
        from ``algo.padding_free``; lit_rlhf/models/packed.py)."""
        if self.kind == "causal_lm":
            from lit_rlhf.models.packed import trunk_hidden_states

            # positions count real tokens only, so left- and right-padded rows score the same
            return trunk_hidden_states(self.trunk, input_ids, attention_mask, self.padding_free)
        return self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def score_hidden(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, H) → (B,) scores."""
        return self.head(pool(hidden, attention_mask, self.pooling))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T) ids and mask (1 = real token) → (B,) float32 scores."""
        return self.score_hidden(self.hidden_states(input_ids, attention_mask), attention_mask)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """(B, T, H) → (B, T, V) next-token logits through the causal LM's head."""
        if self.kind != "causal_lm":
            raise ValueError("an encoder backbone has no LM head")
        return self.backbone.get_output_embeddings()(hidden)

    # ---------------------------------------------------------------- disk
    def save_pretrained(self, directory: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write the backbone (HF format), the head and ``reward_config.json`` into ``directory``."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        if state_dict is None:
            state_dict = self.state_dict()
        backbone_sd = {k[len("backbone.") :]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        head_sd = {k[len("head.proj.") :]: v for k, v in state_dict.items() if k.startswith("head.proj.")}
        self.backbone.save_pretrained(directory, state_dict=backbone_sd)
        save_file(
            {k: v.detach().float().contiguous().cpu() for k, v in head_sd.items()}, os.path.join(directory, HEAD_FILE)
        )
        config = {
            "format": FORMAT,
            "version": 1,
            "kind": self.kind,
            "pooling": self.pooling,
            "hidden_size": self.backbone.config.hidden_size,
        }
        with open(os.path.join(directory, CONFIG_FILE), "w") as fh:
            json.dump(config, fh, indent=2)


def build_reward_model(
    spec: Any, tokenizer: Any, pooling: str = "auto", head_init_std: float | None = None
) -> RewardModel:
    """A fresh reward model: the spec's backbone + a new head (``pooling="auto"``: last for
    causal LMs, mean for encoders). A spec pointing at a saved reward model loads it instead."""
    from lit_rlhf.models.builders import build_causal_lm, build_encoder, resolve_path

    if spec.name_or_path and is_reward_model_dir(resolve_path(spec.name_or_path)):
        return load_reward_model(
            resolve_path(spec.name_or_path), dtype=spec.dtype, gradient_checkpointing=spec.gradient_checkpointing
        )
    if pooling == "auto":
        pooling = "last" if spec.kind == "causal_lm" else "mean"
    backbone = build_causal_lm(spec, tokenizer) if spec.kind == "causal_lm" else build_encoder(spec)
    return RewardModel(backbone, spec.kind, pooling, head_init_std)


def is_reward_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def load_reward_model(path: str, dtype: str = "float32", gradient_checkpointing: bool = False) -> RewardModel:
    """Load a folder written by :meth:`RewardModel.save_pretrained` (tokenizer: ``AutoTokenizer``);
    ``gradient_checkpointing`` for a model that trains (an RM stage resumed from one, a critic).

    Raises:
        lit_rlhf.models.builders.ModelLoadError: not a reward-model folder, or unreadable files.
    """
    from safetensors.torch import load_file

    from lit_rlhf.models.builders import ModelLoadError, build_causal_lm, build_encoder
    from lit_rlhf.models.spec import ModelSpec

    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path} is not a lit_rlhf reward model folder (no {CONFIG_FILE})")
    with open(cfg_path) as fh:
        config = json.load(fh)
    if config.get("format") != FORMAT:
        raise ModelLoadError(f"{cfg_path}: unknown format {config.get('format')!r}, expected {FORMAT!r}")
    spec = ModelSpec(name_or_path=path, kind=config["kind"], dtype=dtype, gradient_checkpointing=gradient_checkpointing)
    backbone = build_causal_lm(spec) if spec.kind == "causal_lm" else build_encoder(spec)
    model = RewardModel(backbone, config["kind"], config["pooling"])
    head = load_file(os.path.join(path, HEAD_FILE))
    model.head.proj.load_state_dict(head)
    return model
