"""Clusters and sweeps: SLURM settings follow the trainer's, and a multirun through submitit's
local executor runs its job with Lightning's 2-process DDP launcher inside (Hydra multirun
combined with the DDP subprocess launcher works: the ranks restart from the job's saved config),
and that job is the suite's check of strategy=ddp_sim through train.py (data split, learning, the
export). One job: each is 4 processes that import everything; a sweep's jobs each getting their own
run directory and logger run is tests/test_short_runs.py's README sweep (Hydra's basic launcher)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose


def test_slurm_launcher_takes_nodes_and_gpus_from_the_trainer():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional extra: pip install -e '.[slurm]'")
    cfg = compose(
        [
            "experiment=ppo_max_llama7b_a100x8",
            "algo.reward_path=/ckpt/rm",
            "hydra/launcher=slurm",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
        ]
    )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)
    assert launcher["partition"] == "gpu" and launcher["max_num_timeout"] == 3


@pytest.mark.slow
@pytest.mark.integration
def test_submitit_local_multirun_with_ddp_in_each_job(tmp_path):
    """The job's two spawned DDP processes split the data (half the steps of one process per epoch),
    learn (held-out perplexity below the untrained model's) and rank 0 exports the trained weights;
    the job reads its own seed. (strategy=ddp_sim through train.py: the one 2-process CLI run.)"""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional extra: pip install -e '.[slurm]'")
    import csv
    import json

    import torch
    from safetensors.torch import load_file

    env = dict(os.environ, HF_HUB_OFFLINE="1", LIT_RLHF_ROOT=str(ROOT))
    summary = tmp_path / "snapshot.json"  # written by rank 0 (tests/helpers/snapshot.py)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "hydra/launcher=submitit_local",
            "experiment=sft_synthetic_tiny",
            "strategy=ddp_sim",
            "trainer.max_epochs=1",
            "data.sft.n_train=256",
            "data.sft.n_val=64",
            "data.batch_size=32",
            "model.tiny.hidden_size=32",
            "model.tiny.num_hidden_layers=1",
            "model.tiny.num_attention_heads=2",
            "model.tiny.intermediate_size=64",
            "logger=csv",
            "trainer.enable_progress_bar=false",
            "seed=2",
            "+callbacks.snapshot._target_=tests.helpers.snapshot.Snapshot",
            f"+callbacks.snapshot.out={summary}",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "0"
    assert OmegaConf.load(job / ".hydra" / "config.yaml").seed == 2
    logs = "".join(p.read_text() for p in (tmp_path / ".submitit").rglob("*_log.err"))
    assert logs.count("MEMBER: 2/2") == 1  # rank 1 of the job joined
    ckpt = torch.load(job / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 4  # 256 pairs / (32 per batch x 2 processes)
    before = json.loads(summary.read_text())["val_perplexity_before"]  # rank 0's half of the validation pairs
    with open(job / "csv" / "metrics.csv") as fh:
        after = [float(r["val/perplexity"]) for r in csv.DictReader(fh) if r.get("val/perplexity")][-1]
    assert after < 0.95 * before
    exported = load_file(job / "policy" / "model.safetensors")
    trained = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert exported.keys() <= trained.keys() and all(torch.equal(v, trained[k]) for k, v in exported.items())
