"""``ValueModel``: the PPO critic, a causal LM trunk with a scalar head on every token."""

from __future__ import annotations

import copy

from torch import Tensor, nn

from lit_rlhf.models.heads import ScalarHead


class ValueModel(nn.Module):
    """V(s_t) for every position t of a sequence: ``head(trunk(ids)[:, t])`` → (B, T).

    Built from a trained causal-LM reward model (same trunk and head: the MOSS-RLHF critic
    initialisation) or from any causal LM with a fresh head.
    """

    def __init__(self, backbone: nn.Module, head: ScalarHead | None = None) -> None:
        super().__init__()
        from lit_rlhf.models.builders import freeze_untied_lm_head

        self.backbone = backbone
        self.head = head if head is not None else ScalarHead(backbone.config.hidden_size)
        freeze_untied_lm_head(backbone)  # values read the trunk only
        self.padding_free = False  # run-time switch (algo.padding_free): packed trunk forwards

    @classmethod
    def from_reward_model(cls, reward_model: nn.Module) -> ValueModel:
        if reward_model.kind != "causal_lm":
            raise ValueError(
                "a critic needs a causal LM trunk; this reward model is an encoder. Set "
                "algo.critic_path to the policy (or a causal-LM reward model)."
            )
        return cls(reward_model.backbone, copy.deepcopy(reward_model.head))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T) ids and mask → (B, T) float32 values (positions follow the mask; padded
        positions hold the head's value of a zero state when ``padding_free``)."""
        from lit_rlhf.models.packed import trunk_hidden_states

        return self.head(trunk_hidden_states(self.backbone.base_model, input_ids, attention_mask, self.padding_free))
