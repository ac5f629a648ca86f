"""Rollout: sampling responses (generate.py), scoring them (score.py), minibatching (minibatches.py)."""
