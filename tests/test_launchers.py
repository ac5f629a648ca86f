"""Clusters and sweeps: SLURM settings follow the trainer's, and a multirun through submitit's
local executor runs its job with Lightning's 2-process DDP launcher inside (Hydra multirun
combined with the DDP subprocess launcher works: the ranks restart from the job's saved config).
One job: each is 4 processes that import everything; a sweep's jobs each getting their own run
directory and seed is tests/test_train.py's multirun test (Hydra's basic launcher)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose


def test_slurm_launcher_takes_nodes_and_gpus_from_the_trainer():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional extra: pip install -e '.[slurm]'")
    cfg = compose(["experiment=ppo_max_llama7b_a100x8", "algo.reward_path=/ckpt/rm", "hydra/launcher=slurm",
                   "trainer.num_nodes=2", "hydra.launcher.partition=gpu"])  # fmt: skip
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)
    assert launcher["partition"] == "gpu" and launcher["max_num_timeout"] == 3


@pytest.mark.slow
@pytest.mark.integration
def test_submitit_local_multirun_with_ddp_in_each_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional extra: pip install -e '.[slurm]'")
    env = dict(os.environ, HF_HUB_OFFLINE="1", LIT_RLHF_ROOT=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=submitit_local", "experiment=sft_synthetic_tiny",
         "strategy=ddp_sim", "trainer.max_steps=2", "data.sft.n_train=64", "data.sft.n_val=16", "logger=none",
         "trainer.enable_progress_bar=false", "callbacks=none", "seed=2", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "0" / "policy" / "model.safetensors").exists()
    assert OmegaConf.load(tmp_path / "0" / ".hydra" / "config.yaml").seed == 2
    logs = "".join(p.read_text() for p in (tmp_path / ".submitit").rglob("*_log.err"))
    assert logs.count("MEMBER: 2/2") == 1  # rank 1 of the job joined
