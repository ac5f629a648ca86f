"""Asynchronous rollouts (``async_rollouts``): lit_rlhf's GRPO on the bench model, the same iterations
synchronously and with the producer process ahead of the trainer by ``algo.rollout.max_staleness`` 1 and
2 (lit_rlhf/rollout/producer.py: the producer samples on one of the 2 cores, the trainer scores and
updates on the other), one fit after the other in one process; every run with the decoupled behaviour
weight (``algo.rollout_correction=decoupled``), so that the objective is the same. The reference's
log-probs are scored where ``algo.rollout.reference_scoring`` says: by the trainer (the default) in
the first two async modes, by the producer in the third, by the side that idles (``balanced``) in
the last."""

from __future__ import annotations

from pathlib import Path

from .common import step_timer
from .grpo import _grpo_ours

MODES = {
    "sync": {},
    "async1": {"mode": "async", "max_staleness": 1},
    "async2": {"mode": "async", "max_staleness": 2},
    "async1_producer_ref": {"mode": "async", "max_staleness": 1, "reference_scoring": "producer"},
    "async2_balanced": {"mode": "async", "max_staleness": 2, "reference_scoring": "balanced"},
}
ASYNC = [m for m in MODES if m != "sync"]


def case_async_rollouts(models: Path, s: dict) -> dict:
    """Iterations/s of each mode: the timed iterations over their total time, after ``warmup + 1``
    (the producer starts in the first; under ``balanced`` scoring consecutive iterations differ in
    length, so a median iteration is not the rate); each async mode's rate over the synchronous
    one's; and the ceiling of any split of the work over the two cores: the synchronous step on ONE
    thread, halved (two processes of one thread each, perfectly balanced, no contention), over the
    synchronous step on two."""
    import torch

    out: dict = {}
    threads = torch.get_num_threads()
    warmup, steps = s["warmup"] + 1, 2 * s["steps"]
    for name, rollout in {**MODES, "sync_1thread": {}}.items():
        timer = step_timer()
        algo = {"rollout_correction": "decoupled", "rollout": rollout}
        trainer, module, data = _grpo_ours(models, s, warmup + steps, [timer], algo=algo)
        torch.set_num_threads(1 if name == "sync_1thread" else threads)
        try:
            trainer.fit(module, data)
        finally:
            torch.set_num_threads(threads)
        stamps = timer.times[warmup - 1 :]
        out[f"{name}_step_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    out["step_s"] = out["sync_step_s"]
    out["samples_per_s"] = s["batch"] / out["sync_step_s"]
    for name in ASYNC:
        out[f"{name}_over_sync"] = out["sync_step_s"] / out[f"{name}_step_s"]
    out["ceiling_over_sync"] = out["sync_step_s"] / (out["sync_1thread_step_s"] / 2)
    return out
