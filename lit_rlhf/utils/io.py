"""Atomic file writes: a temporary file next to the destination, fsync, then ``os.replace``.

The temporary file lives in the destination's own folder (never in ``$TMPDIR``, which may be
another filesystem, where a "move" is a copy that a kill can leave half-done), so the rename is
atomic: readers see the old file or the new one, never a partial write.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(fh)`` on a temporary sibling of ``path``, fsync it, and rename it into place."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, atomically."""
    import torch

    atomic_write(path, lambda fh: torch.save(obj, fh))


# ------------------------------------------------------------------ folders
# A folder cannot be renamed over an existing one atomically (portably), so a folder save goes
#   1. into   .<name>.partial   (removed when found: a save killed while writing)
#   2. rename .<name>.partial -> .<name>.new    (complete from here on)
#   3. rename <name>          -> .<name>.old    (if it exists)
#   4. rename .<name>.new      -> <name>
#   5. remove .<name>.old
# and recover_folder() finishes a sequence cut by a kill: whatever moment the kill hit, <name>
# ends up as the last complete save.


def folder_siblings(path: str) -> tuple[str, str, str]:
    """``(.<name>.partial, .<name>.new, .<name>.old)`` beside ``path``."""
    folder, name = os.path.split(os.path.abspath(path))
    return tuple(os.path.join(folder, f".{name}.{kind}") for kind in ("partial", "new", "old"))  # type: ignore[return-value]


def recover_folder(path: str) -> bool:
    """Finish or clean up a :func:`atomic_folder` sequence a kill interrupted; True if ``path``
    was restored from a complete save."""
    path = os.path.abspath(path)
    partial, new, old = folder_siblings(path)
    shutil.rmtree(partial, ignore_errors=True)
    restored = False
    if os.path.isdir(new):  # complete, not yet in place (killed after step 2 or 3)
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(new, path)
        restored = True
    elif not os.path.exists(path) and os.path.isdir(old):  # cannot happen in the sequence; be safe
        os.replace(old, path)
        restored = True
    shutil.rmtree(old, ignore_errors=True)
    return restored


def begin_folder(path: str) -> str:
    """Step 1: recover from an earlier kill, return an empty ``.<name>.partial`` to write into."""
    recover_folder(path)
    partial, _, _ = folder_siblings(path)
    os.makedirs(partial)
    return partial


def commit_folder(path: str) -> None:
    """Steps 2-5: swap the written ``.<name>.partial`` in as ``path``."""
    path = os.path.abspath(path)
    partial, new, old = folder_siblings(path)
    for root, _, files in os.walk(partial):  # on disk before it counts as complete
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
    os.replace(partial, new)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


def atomic_folder(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(folder)`` on an empty temporary sibling of ``path``, then swap it in: readers
    find the previous complete folder or the new one, never a partial one (after
    :func:`recover_folder`, which the savers and the resume check run)."""
    partial = begin_folder(path)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    commit_folder(path)
