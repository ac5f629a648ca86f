"""Checkpoints survive kills during saves (lit_rlhf/utils/checkpoint_io.py)."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.slow
def test_a_kill_during_a_save_never_destroys_the_last_checkpoint(tmp_path):
    """SIGKILL a process that saves 16 MB checkpoints in a loop, at random moments, 5 times, with
    TMPDIR on another folder: each time, last.ckpt loads and is one whole save; nothing is left
    in TMPDIR, and stale temporary siblings are cleaned by the next save."""
    ckpt, tmpdir = tmp_path / "run" / "last.ckpt", tmp_path / "elsewhere"
    ckpt.parent.mkdir()
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    rng = random.Random(0)
    loaded = []
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "save_loop.py"), str(ckpt)],
                                stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
        assert proc.stdout.readline().strip().isdigit()  # one save completed (torch imported, files warm)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = torch.load(ckpt, weights_only=True)
        assert torch.equal(state["payload"], torch.full((4_000_000,), float(state["i"])))  # whole, not torn
        loaded.append(state["i"])
    assert loaded == sorted(loaded) and loaded[-1] >= 5  # each run continued from the previous checkpoint
    assert list(tmpdir.iterdir()) == []  # TMPDIR is never used
    leftovers = [p.name for p in ckpt.parent.iterdir() if p.name != "last.ckpt"]
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2]); import torch; "
                           "from lit_rlhf.utils.checkpoint_io import AtomicCheckpointIO as A; "
                           "A().save_checkpoint({'i': -1}, sys.argv[1])", str(ckpt), str(ROOT)], env=env)  # fmt: skip
    assert proc.returncode == 0
    assert [p.name for p in ckpt.parent.iterdir()] == ["last.ckpt"], leftovers  # stale temporaries removed
