"""Checkpoints survive kills during saves (lit_rlhf/runtime/checkpoint_io.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.slow
def test_a_kill_during_a_save_never_destroys_the_last_checkpoint(tmp_path):
    """SIGKILL a process that saves 16 MB checkpoints in a loop, at random moments, 3 times, with
    TMPDIR on another folder (tests/helpers/save_loop.py forks each saving process from one
    interpreter): each time, last.ckpt loads and is one whole save; nothing is left in TMPDIR, and
    stale temporary siblings are cleaned by the next save."""
    ckpt, tmpdir, snapshots = tmp_path / "run" / "last.ckpt", tmp_path / "elsewhere", tmp_path / "snapshots"
    for d in (ckpt.parent, tmpdir, snapshots):
        d.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "save_loop.py"), str(ckpt), str(snapshots), "3", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = []
    for k in range(3):
        state = torch.load(snapshots / f"round{k}.ckpt", weights_only=True)
        assert torch.equal(state["payload"], torch.full((4_000_000,), float(state["i"])))  # whole, not torn
        loaded.append(state["i"])
    assert loaded == sorted(loaded) and loaded[-1] >= 3  # each run continued from the previous checkpoint
    before, leftovers = (line.split() for line in proc.stdout.splitlines())  # TMPDIR after the imports; beside
    assert sorted(os.listdir(tmpdir)) == before  # last.ckpt after the third kill. The saves never use TMPDIR
    assert [p.name for p in ckpt.parent.iterdir()] == ["last.ckpt"], leftovers  # stale temporaries removed
    assert torch.load(ckpt, weights_only=True) == {"i": -1}


def _folder(path, text):
    path.mkdir(parents=True)
    (path / "latest").write_text(text)
    (path / "checkpoint").mkdir()
    (path / "checkpoint" / "mp_rank_00_model_states.pt").write_text(text)


def _content(path):
    return (path / "latest").read_text(), (path / "checkpoint" / "mp_rank_00_model_states.pt").read_text()


@pytest.mark.parametrize("killed_after_step", [1, 2, 3, 4])
def test_a_kill_during_a_folder_swap_leaves_a_complete_checkpoint(tmp_path, killed_after_step):
    """Folder saves (DeepSpeed checkpoints, exports) are 5 steps of which 2-5 are renames
    (lit_rlhf/utils/io.py): a kill leaves one of the states built here. The resume check restores
    the newest complete save in each, and nothing of the sequence is left beside it."""
    from lit_rlhf.runtime.checkpoint_io import check_checkpoint_path

    dest = tmp_path / "last.ckpt"
    partial, new, old = (tmp_path / f".last.ckpt.{k}" for k in ("partial", "new", "old"))
    _folder(dest, "save 1")
    if killed_after_step == 1:  # writing the new save
        partial.mkdir()
        (partial / "latest").write_text("save 2, half written")
    if killed_after_step >= 2:
        _folder(new, "save 2")
    if killed_after_step >= 3:
        dest.rename(old)
    if killed_after_step == 4:
        new.rename(dest)
    check_checkpoint_path(str(dest))
    assert _content(dest) == (("save 1", "save 1") if killed_after_step == 1 else ("save 2", "save 2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_atomic_folder_keeps_the_previous_save_when_writing_fails(tmp_path):
    from lit_rlhf.utils.io import atomic_folder

    dest = tmp_path / "policy"
    atomic_folder(str(dest), lambda d: Path(d, "w").write_text("one"))
    assert (dest / "w").read_text() == "one"

    def broken(folder):
        Path(folder, "w").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_folder(str(dest), broken)
    assert (dest / "w").read_text() == "one" and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    atomic_folder(str(dest), lambda d: Path(d, "w").write_text("two"))
    assert (dest / "w").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
