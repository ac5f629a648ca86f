"""Kill checkpoint saves at random moments: ``python tests/helpers/save_loop.py PATH SNAPSHOTS ROUNDS SEED``.

Imports torch and AtomicCheckpointIO once, then ROUNDS times forks a child that saves a 16 MB
checkpoint to PATH through AtomicCheckpointIO over and over (each continuing from the number in the
checkpoint it finds), waits for the child's first completed save, sleeps a random 0-0.6 s and
SIGKILLs it: a kill at a random moment of a save. After each kill it copies PATH, byte for byte, to
SNAPSHOTS/round<k>.ckpt for the test to load. It prints what TMPDIR held before the first save
(the imports' caches, e.g. torchinductor_<user>) and, at the end, the names beside PATH (the
temporaries the kills left); then it saves once more, which must clean them. Used by
tests/runtime/test_checkpoint_io.py (one interpreter start instead of one per round: imports cost seconds).
"""

import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from lit_rlhf.runtime.checkpoint_io import AtomicCheckpointIO


def save_forever(path: str, report: int) -> None:
    io, start = AtomicCheckpointIO(), 0
    if Path(path).exists():
        start = torch.load(path, weights_only=True)["i"] + 1
    for i in range(start, start + 10_000):
        io.save_checkpoint({"i": i, "payload": torch.full((4_000_000,), float(i))}, path)  # 16 MB
        os.write(report, f"{i}\n".encode())


if __name__ == "__main__":
    path, snapshots, rounds, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    print(" ".join(sorted(os.listdir(tempfile.gettempdir()))), flush=True)  # what the imports put in TMPDIR
    for k in range(rounds):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: save until killed
            os.close(read)
            save_forever(path, write)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as lines:
            assert lines.readline().strip().isdigit()  # one save completed (files warm)
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.copyfile(path, snapshots / f"round{k}.ckpt")
    print(" ".join(sorted(p.name for p in Path(path).parent.iterdir() if p.name != Path(path).name)), flush=True)
    AtomicCheckpointIO().save_checkpoint({"i": -1}, path)
