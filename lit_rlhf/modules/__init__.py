"""LightningModules, one per RLHF stage (SFT, reward model, PPO, DPO, GRPO)."""
