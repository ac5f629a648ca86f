"""``python train.py …`` in a checkout = ``lit-rlhf train …`` (lit_rlhf/launch/command.py).

The README's commands use it; runs go under the repository's ``logs/`` wherever they start from
(``paths.root_dir``, lit_rlhf/conf/paths/default.yaml), as they always have.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("LIT_RLHF_ROOT", str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    from lit_rlhf.launch.command import train

    train(sys.argv[1:])
