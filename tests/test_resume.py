"""Exact resume (docs/architecture.md "Exact resume"): a run resumed from any of its checkpoints
(mid-epoch or at an epoch boundary) ends with the same weights and training state as the
uninterrupted run, for every stage; and a real ``train.py`` process killed with SIGKILL resumes to
the same end. CPU, tolerance 1e-6 (in practice the tensors are bit-identical).

Each stage runs on tiny data with a checkpoint after every batch and a validation inside the
first epoch (validation samples, and must not move the training RNG stream)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_rlhf.launch.runner import run
from tests.conftest import ROOT, compose

EVERY_BATCH = [
    "++callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.every_n_epochs=null",
    "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.filename='b{step:05d}'",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]
TINY = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.intermediate_size=64",
]
RL = [
    "validate_before_fit=false",
    "data.prompt.n_train=12",
    "data.prompt.n_val=4",
    "algo.generation.max_new_tokens=6",
    "trainer.max_epochs=2",
    "trainer.max_steps=-1",
    "trainer.val_check_interval=2",
    "optimized_metric=null",
]


def stage_overrides(stage: str, saved_models: tuple[str, str]) -> list[str]:
    policy, rm = f"algo.policy_path={saved_models[0]}", f"algo.reward_path={saved_models[1]}"
    return {  # 2 epochs of 3-4 batches each; validation after every 2nd batch
        "sft": [
            "experiment=sft_synthetic_tiny",
            *TINY,
            "data.sft.n_train=96",
            "data.sft.n_val=16",
            "data.batch_size=32",
            "trainer.max_epochs=2",
            "trainer.val_check_interval=2",
        ],
        "rm": [
            "experiment=rm_synthetic_tiny",
            *TINY,
            "data.preference.n_train=96",
            "data.preference.n_val=16",
            "data.batch_size=32",
            "trainer.max_epochs=2",
            "trainer.val_check_interval=2",
            "test=false",
        ],
        "dpo": [
            "experiment=dpo_synthetic_tiny",
            policy,
            "data.preference.n_train=96",
            "data.preference.n_val=16",
            "data.batch_size=32",
            "trainer.max_epochs=2",
            "trainer.val_check_interval=2",
            "algo.drift_prompts=4",
        ],
        "ppo": [
            "experiment=ppo_max_synthetic_tiny",
            policy,
            rm,
            *RL,
            "algo.rollout_batch_size=4",
            "algo.minibatch_size=2",
        ],
        "grpo": ["experiment=dapo_synthetic_tiny", policy, rm, *RL, "algo.rollout_batch_size=8"],
        "reinforce_pp": [
            "experiment=reinforce_pp_synthetic_tiny",
            policy,
            rm,
            *RL,
            "algo.rollout_batch_size=4",
            "algo.minibatch_size=2",
        ],
        "remax": ["experiment=remax_synthetic_tiny", policy, rm, *RL, "algo.rollout_batch_size=4"],
    }[stage]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_end(a: dict, b: dict, where: str) -> None:
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"], where
    assert a["state_dict"].keys() == b["state_dict"].keys()
    worst = max((x.float() - b["state_dict"][k].float()).abs().max().item() for k, x in a["state_dict"].items())
    assert worst <= 1e-6, f"{where}: weights differ by {worst:.3g}"
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):  # Adam moments too
        for k, s in opt_a["state"].items():
            for name, v in s.items():
                if torch.is_tensor(v):
                    assert torch.allclose(v.float(), opt_b["state"][k][name].float(), atol=1e-6), (where, name)
    assert a["lr_schedulers"] == b["lr_schedulers"], where
    if "lit_rlhf_rl" in a:  # iteration, KL controller, running reward moments, health counters
        assert repr(a["lit_rlhf_rl"]) == repr(b["lit_rlhf_rl"]), where


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo", "grpo", "reinforce_pp", "remax"])
def test_resume_from_any_checkpoint_ends_where_the_uninterrupted_run_ends(stage, tmp_path, saved_models):
    overrides = [*stage_overrides(stage, saved_models), *EVERY_BATCH]
    run(compose(overrides, tmp_path / "full"))
    ckpts = sorted((tmp_path / "full" / "checkpoints").glob("b*.ckpt"))
    assert len(ckpts) >= 6, [p.name for p in ckpts]
    epoch_of = [load(p)["epoch"] for p in ckpts]
    boundary = epoch_of.index(1) - 1  # the last batch of epoch 0
    mid = boundary // 2 if boundary >= 2 else boundary + 1  # inside epoch 0 (or inside epoch 1)
    assert 0 < mid != boundary
    final = load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    for name, index in (("mid-epoch", mid), ("epoch boundary", boundary)):
        out = tmp_path / f"resumed_{index}"
        run(compose([*overrides, f"ckpt_path={ckpts[index]}"], out))
        assert_same_end(
            load(out / "checkpoints" / "last.ckpt"), final, f"{stage}, resumed at {ckpts[index].name} ({name})"
        )


@pytest.mark.slow
@pytest.mark.integration
def test_sigkilled_train_py_resumes_to_the_uninterrupted_end(tmp_path, saved_models):
    """PPO-max (sampling RNG, running reward moments, KL controller, LR schedules, data position),
    as a user does it: `python train.py …` killed with SIGKILL somewhere after its second
    checkpoint, then `python train.py … ckpt_path=<run>/checkpoints/last.ckpt` in the same run
    directory. It must end with the weights of the same run never interrupted."""
    overrides = [*stage_overrides("ppo", saved_models), *EVERY_BATCH, "trainer.max_epochs=4"]  # 12 iterations
    run(compose(overrides, tmp_path / "full"))
    final = load(tmp_path / "full" / "checkpoints" / "last.ckpt")

    killed_at = kill_and_resume(overrides, tmp_path / "killed", final["global_step"])
    end = load(tmp_path / "killed" / "checkpoints" / "last.ckpt")
    assert_same_end(end, final, f"ppo_max killed after global step {killed_at}")


def kill_and_resume(overrides: list[str], run_dir: Path, steps: int) -> int:
    """``python train.py <overrides>`` in ``run_dir``, SIGKILLed once its second checkpoint is written
    (producer processes and all), then the same command with ``ckpt_path`` of its ``last.ckpt``, which
    must run to the end; returns the global step it was killed at (between 0 and ``steps``). The
    thread count is the in-process runs': the same sums."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        LIT_RLHF_ROOT=str(ROOT),
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list((run_dir / "checkpoints").glob("b*.ckpt"))) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "no second checkpoint in 300 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {err[-2000:]}"
    killed_at = load(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    assert 0 < killed_at < steps
    resumed = subprocess.run(
        [*cmd, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return killed_at
