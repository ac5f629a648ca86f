"""Asynchronous rollouts (``async_rollouts``): lit_rlhf's GRPO on the bench model, the same iterations
synchronously and with the producer process ahead of the trainer by ``algo.rollout.max_staleness`` 1 and
2 (lit_rlhf/rollout/producer.py: the producer samples on one of the 2 cores, the trainer scores and
updates on the other), one fit after the other in one process; every run with the decoupled behaviour
weight (``algo.rollout_correction=decoupled``), so that the objective is the same."""

from __future__ import annotations

import time
from pathlib import Path

from .common import median_step, step_timer
from .grpo import _grpo_ours

MODES = {
    "sync": {},
    "async1": {"mode": "async", "max_staleness": 1},
    "async2": {"mode": "async", "max_staleness": 2},
    "async1_ref": {"mode": "async", "max_staleness": 1, "reference_in_producer": True},
}


def case_async_rollouts(models: Path, s: dict) -> dict:
    """Seconds per GRPO iteration of each mode (median after ``warmup``; the producer starts in the
    first), each async mode's iterations/s over the synchronous run's, and the ceiling of any split
    of the work over the two cores: the synchronous step on ONE thread, halved (two processes of one
    thread each, perfectly balanced, no contention), over the synchronous step on two."""
    import torch

    out: dict = {}
    threads = torch.get_num_threads()
    for name, rollout in {**MODES, "sync_1thread": {}}.items():
        timer = step_timer()
        algo = {"rollout_correction": "decoupled", "rollout": rollout}
        trainer, module, data = _grpo_ours(models, s, s["warmup"] + s["steps"], [timer], algo=algo)
        torch.set_num_threads(1 if name == "sync_1thread" else threads)
        started = time.perf_counter()
        try:
            trainer.fit(module, data)
        finally:
            torch.set_num_threads(threads)
        out[f"{name}_step_s"] = median_step([started] + timer.times, s["warmup"])
    out["step_s"] = out["sync_step_s"]
    out["samples_per_s"] = s["batch"] / out["sync_step_s"]
    for name in ("async1", "async2", "async1_ref"):
        out[f"{name}_over_sync"] = out["sync_step_s"] / out[f"{name}_step_s"]
    out["ceiling_over_sync"] = out["sync_step_s"] / (out["sync_1thread_step_s"] / 2)
    return out
