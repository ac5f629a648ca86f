"""Rollout: sampling responses (generate.py: the hf loop, vllm_engine.py: the vLLM engine), the models'
forwards over them (forward.py), reward scorers (scorers.py), and the one rollout path (collect.py)."""
