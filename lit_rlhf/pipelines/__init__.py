"""Pipelines: several stage jobs run in order and evaluated together — the demo and the algorithm
zoo (:mod:`lit_rlhf.pipelines.demo`: SFT → RM → RL stages → a gold-reward table) and the reasoning
pipeline (:mod:`lit_rlhf.pipelines.reasoning`: SFT → GRPO-family stages → an accuracy table). Each
stage is an ordinary train.py job (lit_rlhf/launch/runner.py)."""
