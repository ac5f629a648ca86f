"""``AtomicCheckpointIO``: Lightning checkpoints written so that a kill never destroys the last one.

Lightning's own save goes through an fsspec transaction, whose temporary file lives in
``$TMPDIR``: when that is another filesystem than the run directory (``/dev/shm``, node-local
scratch), the final "move" is a copy, and a SIGKILL during it leaves a truncated checkpoint in
place of the previous good one. Here the temporary file is a sibling of the destination, fsynced,
then renamed over it (atomic on POSIX): readers see the old checkpoint or the new one. Stale
temporary siblings of a killed save are removed by the next save. Remote paths (``s3://`` …) keep
Lightning's own path. The runner installs it for every run (lit_rlhf/launch/runner.py).

DeepSpeed writes checkpoint *folders* itself (no CheckpointIO applies): :func:`atomic_deepspeed_saves`
routes them through a sibling folder swapped in at the end (lit_rlhf/utils/io.py, "folders"), and
:func:`check_checkpoint_path` finishes a swap a kill interrupted before a resume reads the folder.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_rlhf.utils.io import atomic_write, begin_folder, commit_folder, folder_siblings, recover_folder

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = str(path)
        if "://" in path and not path.startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = path.removeprefix("file://")
        for stale in glob.glob(
            os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-*")
        ):
            os.unlink(stale)  # a save killed before its rename
        atomic_write(path, lambda fh: torch.save(checkpoint, fh))


def atomic_deepspeed_saves(strategy: Any) -> None:
    """Make ``strategy.save_checkpoint`` (a DeepSpeedStrategy's: every rank writes its shards into
    one folder) write into ``.<name>.partial`` and swap it in once all ranks are done, so that a
    kill never leaves ``last.ckpt/`` half written. Wraps the instance's method
    (:func:`lit_rlhf.utils.compat.lightning.wrap_save_checkpoint`: any DeepSpeedStrategy subclass keeps
    its own saving code)."""
    from lit_rlhf.utils.compat.lightning import wrap_save_checkpoint

    wrap_save_checkpoint(strategy, lambda original: _atomic_folder_save(strategy, original))


def _atomic_folder_save(strategy: Any, original: Any) -> Any:
    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        filepath = strategy.broadcast(str(filepath))
        if "://" in filepath and not filepath.startswith("file://"):
            return original(checkpoint, filepath, storage_options)
        filepath = filepath.removeprefix("file://")
        partial = begin_folder(filepath) if strategy.is_global_zero else folder_siblings(filepath)[0]
        strategy.barrier("atomic_checkpoint_begin")
        original(checkpoint, partial, storage_options)
        strategy.barrier("atomic_checkpoint_written")
        if strategy.is_global_zero:
            commit_folder(filepath)
        strategy.barrier("atomic_checkpoint_committed")

    return save_checkpoint


def _global_rank() -> int:
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def check_checkpoint_path(path: str | None) -> None:
    """``ckpt_path`` must be Lightning's "last"/"best"/"hpc", a torch checkpoint file (a complete zip
    archive), or a DeepSpeed checkpoint folder: anything else is a ConfigError naming the key,
    before a model is built (not an EOFError or UnpicklingError from deep inside a resume)."""
    import zipfile

    from lit_rlhf.utils.config import ConfigError

    if path is None or str(path) in ("last", "best", "hpc", "registry") or "://" in str(path):
        return
    path = str(path)
    partial, new, old = folder_siblings(path)
    if any(os.path.isdir(p) for p in (partial, new, old)):  # a DeepSpeed folder save cut by a kill
        if _global_rank() == 0:
            if recover_folder(path):
                log.warning(
                    "%s: finished a checkpoint save a kill had interrupted (the newest complete one is in place)", path
                )
        else:  # ranks started together (torchrun, SLURM): rank 0 puts it in place
            deadline = time.monotonic() + 120
            while os.path.isdir(new) and time.monotonic() < deadline:
                time.sleep(0.5)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "latest")) and not glob.glob(
            os.path.join(path, "*", "*model_states.pt")
        ):
            raise ConfigError("ckpt_path", f"{path} is a folder but not a DeepSpeed checkpoint (no 'latest' file)")
        return
    if not os.path.isfile(path):
        raise ConfigError("ckpt_path", f"no such checkpoint file: {path}")
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            "ckpt_path",
            f"{path} is not a complete checkpoint (not a torch archive: truncated by a kill, or another kind of file)",
        )
    with zipfile.ZipFile(path) as archive:
        if not any(name.endswith("data.pkl") for name in archive.namelist()):
            raise ConfigError("ckpt_path", f"{path} is a zip archive but not a torch checkpoint")
