"""Asynchronous rollouts (``async_rollouts``): lit_rlhf's GRPO on the bench model, synchronous and with
the producer process ahead of the trainer by ``algo.rollout.max_staleness`` 1 and 2
(lit_rlhf/rollout/producer.py: the producer samples on one of the 2 cores, the trainer scores and
updates on the other), every run with the decoupled behaviour weight
(``algo.rollout_correction=decoupled``), so that the objective is the same.

The modes are measured in rounds, iteration by iteration, so that each ratio compares iterations
seconds apart (this VM's speed drifts by 20% within minutes: runs one after the other gave ratios
from 1.08 to 1.37). The synchronous run trains in this process; each async run trains in a process
of its own and waits for its turn at the start of each iteration. A round is one iteration of each
async run (its producer runs during its turn only: it is stopped, SIGSTOP, the rest of the time),
then one synchronous iteration on 2 threads and one on 1 thread. Every iteration thus has the
machine to itself, and an async turn holds both of its processes' work for one iteration.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from .grpo import _grpo_ours

SIDES = {
    "async1": {"mode": "async", "max_staleness": 1},
    "async2": {"mode": "async", "max_staleness": 2},
    "async2_balanced": {"mode": "async", "max_staleness": 2, "reference_scoring": "balanced"},
}
"""The async runs, each against the synchronous one: bound 1 and 2 with the trainer scoring the
reference's log-probs (the default), and bound 2 with them split between the two sides (``balanced``)."""
ROUNDS = 20  # timed rounds of a full run (one iteration per mode each)
TIMEOUT_S = 600.0  # an async run that does not come back to its turn this long is an error


def _side(name: str, models: Path, s: dict, turns: int, threads: int, conn: Any) -> None:
    """An async run of ``turns`` iterations (a process of its own): at the start of each iteration it
    tells the bench its producer's pid and waits for its turn; ``"end"`` after the fit."""
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(threads)

    class Turn(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            producer = module.producer
            conn.send(producer.process.pid if producer is not None and producer.process is not None else None)
            conn.recv()

    algo = {"rollout_correction": "decoupled", "rollout": SIDES[name]}
    trainer, module, data = _grpo_ours(models, s, turns, [Turn()], algo=algo)
    trainer.fit(module, data)
    conn.send("end")


def _context() -> Any:
    """Processes forked from a fork server that imported the GRPO run's modules once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["lightning.pytorch", "transformers", "lit_rlhf.modules.critic_free", __name__])
    return ctx


class Side:
    """The bench's handle on one async run: :meth:`turn` lets it run one iteration (its producer
    continued for the turn, stopped after) and times it."""

    def __init__(self, name: str, models: Path, s: dict, turns: int, threads: int) -> None:
        ctx = _context()
        self.name, self.pid, self.cycles = name, None, []
        self.conn, theirs = ctx.Pipe()
        args = (name, models, s, turns, threads, theirs)
        # not a daemon: the run starts a producer process of its own
        self.process = ctx.Process(target=_side, args=args, name=f"bench-{name}")
        self.process.start()
        theirs.close()
        self.pid = self._next()  # its first iteration's start

    def _next(self) -> Any:
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"{self.name}: no iteration started in {TIMEOUT_S:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: the async run died (exit code {self.process.exitcode})") from None

    def _signal(self, sig: int) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # a producer the run restarted
                pass

    def turn(self) -> None:
        self._signal(signal.SIGCONT)
        started = time.perf_counter()
        self.conn.send("go")
        message = self._next()
        self.cycles.append(time.perf_counter() - started)
        if message == "end":
            self.pid = None
            return
        self.pid = message
        self._signal(signal.SIGSTOP)

    def close(self, failed: bool) -> None:
        """Wait for the run's end; kill it (and so its producer) when the bench ``failed``."""
        self._signal(signal.SIGCONT)
        self.process.join(5 if failed else TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def case_async_rollouts(models: Path, s: dict) -> dict:
    """Per mode, the median over the timed rounds of the synchronous iteration (2 threads) over the
    mode's iteration of the same round, with its quartiles; each mode's median iteration; and the
    ceiling of any split of the work over the two cores: per round, the synchronous iteration on
    two threads over half of the one on ONE thread (two processes of one thread each, perfectly
    balanced, no contention)."""
    import lightning.pytorch as pl
    import torch

    threads = torch.get_num_threads()
    warmup = s["warmup"] + 1  # the async runs start their producers in the first
    rounds = 1 if s["steps"] == 1 else ROUNDS
    turns = warmup + rounds + 1  # the last turn holds the run's teardown: not timed
    sides: list[Side] = []
    cycles: dict[str, list[float]] = {"sync": [], "sync_1thread": []}
    clock: dict[str, Any] = {"mode": None, "since": 0.0}

    class Rounds(pl.Callback):
        """At each synchronous iteration's start: time the one before; before every other one,
        the async runs' turns, then 2 threads; else 1."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if clock["mode"] is not None:
                cycles[clock["mode"]].append(time.perf_counter() - clock["since"])
            if batch_idx % 2 == 0:
                for side in sides:
                    side.turn()
            clock["mode"] = "sync" if batch_idx % 2 == 0 else "sync_1thread"
            torch.set_num_threads(threads if batch_idx % 2 == 0 else 1)
            clock["since"] = time.perf_counter()

    failed = True
    try:
        for name in SIDES:
            sides.append(Side(name, models, s, turns, threads))
        trainer, module, data = _grpo_ours(models, s, 2 * turns, [Rounds()], algo={"rollout_correction": "decoupled"})
        trainer.fit(module, data)
        failed = False
    finally:
        torch.set_num_threads(threads)
        for side in sides:
            side.close(failed)
    timed = slice(warmup, warmup + rounds)
    sync, one = cycles["sync"][timed], cycles["sync_1thread"][timed]
    out: dict = {
        "paired_rounds": rounds,
        "sync_step_s": statistics.median(sync),
        "sync_1thread_step_s": statistics.median(one),
    }
    for side in sides:
        mine = side.cycles[timed]
        ratios = [a / b for a, b in zip(sync, mine)]
        out[f"{side.name}_step_s"] = statistics.median(mine)
        out[f"{side.name}_over_sync"] = statistics.median(ratios)
        out[f"{side.name}_over_sync_quartiles"] = _quartiles(ratios)
    ceiling = [2 * a / b for a, b in zip(sync, one)]
    out["ceiling_over_sync"] = statistics.median(ceiling)
    out["ceiling_over_sync_quartiles"] = _quartiles(ceiling)
    out["step_s"] = out["sync_step_s"]
    out["samples_per_s"] = s["batch"] / out["sync_step_s"]
    return out


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartile (the values themselves when fewer than two)."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]
