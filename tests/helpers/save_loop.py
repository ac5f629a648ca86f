"""Save a checkpoint to PATH over and over through AtomicCheckpointIO until killed; prints each
completed save's number. Used by tests/test_checkpoint_io.py to kill saves at random moments.

    python tests/helpers/save_loop.py PATH
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lit_rlhf.runtime.checkpoint_io import AtomicCheckpointIO  # noqa: E402

if __name__ == "__main__":
    io, start = AtomicCheckpointIO(), 0
    if Path(sys.argv[1]).exists():
        start = torch.load(sys.argv[1], weights_only=True)["i"] + 1
    for i in range(start, start + 10_000):
        io.save_checkpoint({"i": i, "payload": torch.full((4_000_000,), float(i))}, sys.argv[1])  # 16 MB
        print(i, flush=True)
