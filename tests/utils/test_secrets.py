"""Secrets (lit_rlhf/utils/secrets.py): masked in files, but DDP ranks started from the masked
``.hydra/config.yaml`` (Lightning's launcher under Hydra) get the real values back."""

from __future__ import annotations

from omegaconf import OmegaConf

from lit_rlhf.utils.secrets import ENV, MASK, MaskSecrets, is_secret, restore_secrets


def test_secret_names():
    assert all(is_secret(k) for k in ("api_key", "+wandb_api_key", "algo.reward_fn.api_key", "hf_token", "password"))
    assert not any(is_secret(k) for k in ("max_new_tokens", "pad_token", "tokenizer", "model.tokenizer"))


def test_ranks_started_from_the_masked_config_get_the_values_back(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    job = OmegaConf.create(
        {
            "hydra": {"output_subdir": ".hydra", "runtime": {"output_dir": str(tmp_path)}},
            "algo": {"reward_fn": {"_target_": "my.judge", "api_key": "sk-real-1"}},
            "seed": 3,
            "wandb_api_key": "sk-real-2",
        }
    )
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save({k: v for k, v in job.items() if k != "hydra"}, tmp_path / ".hydra" / "config.yaml")
    MaskSecrets().on_job_start(job)  # rank 0: Hydra wrote the files, the callback masks them
    written = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "sk-real" not in written and MASK in written
    rank1 = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")  # what Lightning's launcher hands rank 1
    OmegaConf.set_struct(rank1, True)
    assert rank1.algo.reward_fn.api_key == MASK
    restore_secrets(rank1)  # train.py does this first (the environment is inherited)
    assert rank1.algo.reward_fn.api_key == "sk-real-1" and rank1.wandb_api_key == "sk-real-2" and rank1.seed == 3
    other = OmegaConf.create({"api_key": "user-typed-value"})  # only masked values are replaced
    restore_secrets(other)
    assert other.api_key == "user-typed-value"
