"""Atomic file writes: a temporary file next to the destination, fsync, then ``os.replace``.

The temporary file lives in the destination's own folder (never in ``$TMPDIR``, which may be
another filesystem, where a "move" is a copy that a kill can leave half-done), so the rename is
atomic: readers see the old file or the new one, never a partial write.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable


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
