"""Asynchronous rollouts (``async_rollouts``): lit_rlhf's GRPO on the bench model, synchronous and with
the producer process ahead of the trainer by ``algo.rollout.max_staleness`` 1, 2 and 3
(lit_rlhf/rollout/producer.py: the producer samples on one of the 2 cores, the trainer scores and
updates on the other), every run with the decoupled behaviour weight
(``algo.rollout_correction=decoupled``), so that the objective is the same.

The modes are measured in rounds, iteration by iteration, so that each ratio compares iterations
seconds apart (this VM's speed drifts by 20% within minutes: runs one after the other gave ratios
from 1.08 to 1.37). The synchronous run trains in this process; each async run trains in a process
of its own and waits for its turn at the start of each iteration. A round is one iteration of each
async run (its producer runs during its turn only: it is stopped, SIGSTOP, the rest of the time),
then one synchronous iteration on 2 threads, one on 1 thread, and one more on 1 thread beside a
*neighbour*: another synchronous GRPO run on one thread, continued (SIGCONT) for that iteration only.
Every other iteration thus has the machine to itself, and an async turn holds both of its processes'
work for one iteration.

Two ceilings bound what any split of the work over two single-thread processes can gain: with the
other core idle (the synchronous iteration on 2 threads over half of the one on 1 thread), and with
the other core busy (over half of the one beside the neighbour). Two processes that work at once
slow each other down (they share the caches and the memory bus); the second ceiling counts that,
and an async run's two processes always work at once.
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
    "async2_balanced": {"mode": "async", "max_staleness": 2, "reference_scoring": "balanced"},
    "async2_merged": {"mode": "async", "max_staleness": 2, "reference_scoring": "balanced", "merge_rollouts": 3},
    "async3_merged": {"mode": "async", "max_staleness": 3, "reference_scoring": "balanced", "merge_rollouts": 2},
}
"""The async runs, each against the synchronous one: bound 1 with the trainer scoring the reference's
log-probs (the default); bound 2 with them split between the two sides (``balanced``); that with
the rollouts the bound admits at once sampled as one batch (``merge_rollouts`` 3: all of them); and
bound 3, balanced, two rollouts to a batch (a producer that is behind finds two admitted more often)."""
ROUNDS = 20  # timed rounds of a full run (one iteration per mode each)
TIMEOUT_S = 600.0  # an async run that does not come back to its turn this long is an error
NEIGHBOUR_STEPS = 10**9  # the neighbour trains until the bench kills it: it must not end in a phase


def _set_threads(n: int) -> None:
    """This process's torch threads, checked: where a smoke run built a CPU vLLM engine in this
    process first, ``torch.set_num_threads`` is vLLM's no-op (lit_rlhf.utils.compat.torch.set_num_threads),
    and a "1 thread" phase would silently run on all of them."""
    import torch

    from lit_rlhf.utils.compat.torch import set_num_threads

    set_num_threads(n)
    if torch.get_num_threads() != n:
        raise RuntimeError(f"torch runs on {torch.get_num_threads()} threads, not the {n} the phase needs")


def _side(name: str, models: Path, s: dict, turns: int, threads: int, conn: Any) -> None:
    """An async run of ``turns`` iterations (a process of its own): at the start of each iteration it
    tells the bench its producer's pid and waits for its turn; ``"end"`` after the fit."""
    import lightning.pytorch as pl

    _set_threads(threads)

    class Turn(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            producer = module.producer
            conn.send(producer.process.pid if producer is not None and producer.process is not None else None)
            conn.recv()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            merged.append(float(trainer.callback_metrics.get("async/producer_merged", 1.0)))

    merged: list[float] = []  # each iteration's rollouts sampled in its rollout's batch
    algo = {"rollout_correction": "decoupled", "rollout": SIDES[name]}
    trainer, module, data = _grpo_ours(models, s, turns, [Turn()], algo=algo)
    trainer.fit(module, data)
    conn.send("end")
    conn.send(merged)


def _neighbour(models: Path, s: dict, steps: int, conn: Any) -> None:
    """A synchronous GRPO run on one thread (a process of its own) that the bench continues only
    while it times the synchronous run beside it: it says when its first iteration starts."""
    import lightning.pytorch as pl

    _set_threads(1)

    class Started(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 0 and batch_idx == 0:
                conn.send("started")

    trainer, module, data = _grpo_ours(models, s, steps, [Started()], algo={"rollout_correction": "decoupled"})
    trainer.fit(module, data)


def _context() -> Any:
    """Processes forked from a fork server that imported the GRPO run's modules once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["lightning.pytorch", "transformers", "lit_rlhf.modules.critic_free", __name__])
    return ctx


def _launch(target: Any, args: tuple, name: str) -> tuple[Any, Any, Any]:
    """(process, connection, its first message): ``target(*args, conn)`` started in a process of its
    own (not a daemon: an async run starts a producer of its own), killed if no message comes."""
    ctx = _context()
    conn, theirs = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, theirs), name=name)
    process.start()
    theirs.close()
    try:
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError(f"{name}: no iteration started in {TIMEOUT_S:.0f} s")
        return process, conn, conn.recv()
    except BaseException:  # not in the bench's lists yet: nothing else would stop it
        process.kill()
        raise


class Side:
    """The bench's handle on one async run: :meth:`turn` lets it run one iteration (its producer
    continued for the turn, stopped after) and times it."""

    def __init__(self, name: str, models: Path, s: dict, turns: int, threads: int) -> None:
        self.name, self.cycles, self.cpu, self.merged = name, [], [], []
        # its producer's pid at its first iteration's start
        self.process, self.conn, self.pid = _launch(_side, (name, models, s, turns, threads), f"bench-{name}")

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

    def _cpu_s(self) -> float | None:
        """CPU seconds the run's trainer and producer processes have used (None: not on Linux)."""
        used = [cpu_seconds(self.process.pid)] + [cpu_seconds(self.pid)] * (self.pid is not None)
        return None if None in used else sum(used)

    def turn(self) -> None:
        cpu = self._cpu_s()
        self._signal(signal.SIGCONT)
        started = time.perf_counter()
        self.conn.send("go")
        message = self._next()
        self.cycles.append(time.perf_counter() - started)
        after = self._cpu_s()  # a restarted producer's first turn: not counted
        self.cpu.append(None if cpu is None or after is None or message != self.pid else after - cpu)
        if message == "end":
            self.pid, self.merged = None, self.conn.recv()
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


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (/proc; None where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Neighbour:
    """The bench's handle on the neighbour run: stopped (SIGSTOP) but while :meth:`busy`."""

    def __init__(self, models: Path, s: dict, steps: int) -> None:
        self.process, self.conn, _ = _launch(_neighbour, (models, s, steps), "bench-neighbour")
        self.busy(False)

    def busy(self, on: bool) -> None:
        try:
            os.kill(self.process.pid, signal.SIGCONT if on else signal.SIGSTOP)
        except ProcessLookupError:
            self.process.join(5)
            raise RuntimeError(f"the neighbour run ended (exit code {self.process.exitcode})") from None

    def close(self) -> None:
        """Kill it (it may have finished: the synchronous run's last iteration continues it)."""
        try:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        except ProcessLookupError:
            pass
        self.process.join()


def case_async_rollouts(models: Path, s: dict) -> dict:
    """Per mode, the median over the timed rounds of the synchronous iteration (2 threads) over the
    mode's iteration of the same round, with its quartiles, and the same over all rounds together
    (``_total``: the summed synchronous iterations over the mode's, the throughput; where a mode's
    iterations alternate long and short, as merged batches make them, the median round overstates
    it); each mode's median iteration and the mean over its iterations of the rollouts sampled in
    one batch with the iteration's (``_merged``); and the two ceilings of any split of the work over
    the two cores: per round (and in total), the synchronous iteration on two threads over half of
    the one on ONE thread, alone (two processes of one thread each, perfectly balanced, that do not
    slow each other down) and beside the neighbour (that do)."""
    import lightning.pytorch as pl
    import torch

    from lit_rlhf.utils.compat.torch import set_num_threads

    threads = torch.get_num_threads()
    warmup = s["warmup"] + 1  # the async runs start their producers in the first
    rounds = 1 if s["steps"] == 1 else ROUNDS
    turns = warmup + rounds + 1  # the last turn holds the run's teardown: not timed
    sides: list[Side] = []
    phases = ("sync", "sync_1thread", "sync_1thread_busy")  # a round's synchronous iterations
    cycles: dict[str, list[float]] = {phase: [] for phase in phases}
    cpu: dict[str, list[float]] = {phase: [] for phase in phases}  # this process's CPU seconds
    clock: dict[str, Any] = {"mode": None, "since": 0.0, "iterations": 0}
    neighbour: list[Neighbour] = []

    class Rounds(pl.Callback):
        """At each synchronous iteration's start: time the one before; then, by turn, the async
        runs' turns and 2 threads, or 1 thread, or 1 thread beside the neighbour."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if clock["mode"] is not None:
                cycles[clock["mode"]].append(time.perf_counter() - clock["since"])
                cpu[clock["mode"]].append(time.process_time() - clock["cpu"])
            neighbour[0].busy(False)
            phase = phases[clock["iterations"] % len(phases)]  # batch_idx restarts with each epoch
            clock["iterations"] += 1
            if phase == "sync":
                for side in sides:
                    side.turn()
            clock["mode"] = phase
            _set_threads(threads if phase == "sync" else 1)
            neighbour[0].busy(phase == "sync_1thread_busy")
            clock["since"], clock["cpu"] = time.perf_counter(), time.process_time()

    failed = True
    try:
        for name in SIDES:
            sides.append(Side(name, models, s, turns, threads))
        neighbour.append(Neighbour(models, s, NEIGHBOUR_STEPS))
        algo = {"rollout_correction": "decoupled"}
        trainer, module, data = _grpo_ours(models, s, len(phases) * turns, [Rounds()], algo=algo)
        trainer.fit(module, data)
        failed = False
    finally:
        set_num_threads(threads)  # unchecked: a check failing here would hide the fit's error
        for n in neighbour:  # first: the last iteration continued it, and it would train on alone
            n.close()
        for side in sides:
            side.close(failed)
    timed = slice(warmup, warmup + rounds)
    sync, one, busy = (cycles[phase][timed] for phase in phases)
    out: dict = {
        "paired_rounds": rounds,
        "sync_step_s": statistics.median(sync),
        "sync_1thread_step_s": statistics.median(one),
        "sync_1thread_busy_step_s": statistics.median(busy),
        "sync_1thread_cpu_s": statistics.median(cpu["sync_1thread"][timed]),
    }
    for side in sides:
        mine = side.cycles[timed]
        ratios = [a / b for a, b in zip(sync, mine)]
        out[f"{side.name}_step_s"] = statistics.median(mine)
        _median(out, f"{side.name}_over_sync", ratios)
        out[f"{side.name}_over_sync_total"] = sum(sync) / sum(mine)
        out[f"{side.name}_merged"] = statistics.mean(side.merged[timed]) if side.merged[timed] else 1.0
        used = [(c, t) for c, t in zip(side.cpu[timed], mine) if c is not None]
        if used:  # CPU seconds of both processes per iteration, and the share of two cores they kept busy
            out[f"{side.name}_cpu_s"] = statistics.median(c for c, _ in used)
            out[f"{side.name}_cores_busy"] = statistics.median(c / (2 * t) for c, t in used)
    _median(out, "ceiling_over_sync", [2 * a / b for a, b in zip(sync, one)])
    _median(out, "ceiling_busy_over_sync", [2 * a / b for a, b in zip(sync, busy)])
    out["ceiling_over_sync_total"] = 2 * sum(sync) / sum(one)
    out["ceiling_busy_over_sync_total"] = 2 * sum(sync) / sum(busy)
    slowdown = [b / a for a, b in zip(one, busy)]
    out["neighbour_slowdown"] = statistics.median(slowdown)  # 1 thread: beside the neighbour / alone
    out["step_s"] = out["sync_step_s"]
    out["samples_per_s"] = s["batch"] / out["sync_step_s"]
    return out


def _median(out: dict, key: str, ratios: list[float]) -> None:
    """``out[key]``: the median of the rounds' ``ratios``; ``out[key + "_quartiles"]``: their quartiles."""
    out[key] = statistics.median(ratios)
    out[f"{key}_quartiles"] = _quartiles(ratios)


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartile (the values themselves when fewer than two)."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]
