"""Several helper scripts' runs in ONE launch of N processes: process start-up (each rank imports torch,
transformers and Lightning: ~9 s of CPU) is most of a tiny-model run's cost, so tests/test_distributed.py
runs its 2-process DPO, GRPO, PPO and reward-model runs in the same processes, one after the other.

    python tests/helpers/multiproc.py dpo_multiproc --strategy ddp --devices 2 ... --then ppo_multiproc ...

Each run names its helper (a module of tests/helpers with a ``PARSER`` for one run's command line and
``run(args)``) followed by that helper's arguments; every run is a fresh module, data module, strategy
and trainer, the process group stays up. All runs need the same ``--devices``.

Run as a script: Lightning's subprocess launcher re-executes it once per extra rank.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers importable when run as a script

import torch  # noqa: E402

from tests.helpers.cpu_strategies import split_runs  # noqa: E402


def main() -> None:
    runs = []
    for argv in split_runs(sys.argv[1:]):
        if not argv:
            sys.exit("multiproc.py: every run starts with its helper's name (e.g. ppo_multiproc)")
        helper = importlib.import_module(f"tests.helpers.{argv[0]}")
        runs.append((helper, helper.PARSER.parse_args(argv[1:])))
    if len({args.devices for _, args in runs}) != 1:
        sys.exit("multiproc.py: every run of one launch needs the same --devices (the processes are started once)")
    torch.set_num_threads(1)
    for helper, args in runs:
        helper.run(args)


if __name__ == "__main__":
    main()
