"""Faults injected into the asynchronous rollouts' producer (tests/rollout/test_producer.py): top-level,
so that the producer process (spawned) can unpickle them."""

from __future__ import annotations

import random


def heavy_tailed(ticket: int) -> float:
    """Seconds a ticket's sampling is held back: mostly nothing, one in five a Pareto-tailed pause."""
    rng = random.Random(ticket)
    return 0.0 if rng.random() < 0.8 else min(0.05 * rng.paretovariate(1.2), 1.5)


def first_slow(ticket: int) -> float:
    """:func:`heavy_tailed`, and a first ticket that takes half a second: the tickets handed out
    meanwhile are waiting together when the producer is done with it (a merged batch)."""
    return 0.5 if ticket == 0 else heavy_tailed(ticket)


class Stuck:
    """A producer that takes a minute for every ticket, and says so in the file ``marker`` when it
    starts one (the test kills its trainer then)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, ticket: int) -> float:
        with open(self.marker, "w") as fh:
            fh.write(str(ticket))
        return 60.0


def broken(ticket: int) -> float:
    """A producer whose sampling raises (a bug in a user's environment, say)."""
    raise ValueError(f"ticket {ticket}: the environment is broken")


def misconfigured(ticket: int) -> float:
    """A producer that meets a configuration error (a vLLM engine refusing the model, say)."""
    from lit_rlhf.utils.config import ConfigError

    raise ConfigError("algo.generation.engine", "no kernel for this head size")


def producer_killer(marker: str, after: int = 1):
    """``algo.reward_fn`` of the embedded task (its gold reward) that, at its call ``after + 1``, SIGKILLs
    the run's rollout producer, once per ``marker`` file (a resumed run's producer lives): a producer
    gone for good mid-run, with ``algo.rollout.restarts=0``."""
    import multiprocessing
    import os
    import signal

    from lit_rlhf.data.synthetic import gold_reward_fn

    gold, calls = gold_reward_fn(), [0]

    def reward(prompts, responses, ended=None):
        calls[0] += 1
        if calls[0] == after + 1 and not os.path.exists(marker):
            for child in multiprocessing.active_children():
                if child.name == "lit_rlhf-rollout-producer":
                    os.kill(child.pid, signal.SIGKILL)
                    open(marker, "w").close()
        return gold(prompts, responses, ended)

    return reward


def slow(ticket: int) -> float:
    """A producer slower than its trainer: every ticket takes 0.3 s more."""
    return 0.3


def reward_failing_at(call: int = 2):
    """``algo.reward_fn`` of the embedded task (its gold reward) that raises at its call ``call``: a
    fit that fails mid-run, in the trainer."""
    from lit_rlhf.data.synthetic import gold_reward_fn

    gold, calls = gold_reward_fn(), [0]

    def reward(prompts, responses, ended=None):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"reward call {call}: the grader is broken")
        return gold(prompts, responses, ended)

    return reward


class Logged:
    """A producer that writes each ticket it starts to the file ``log`` (a line each) and takes
    ``seconds`` more over it."""

    def __init__(self, log: str, seconds: float) -> None:
        self.log, self.seconds = log, seconds

    def __call__(self, ticket: int) -> float:
        with open(self.log, "a") as fh:
            fh.write(f"{ticket}\n")
        return self.seconds


def wait_for_version(board, need: int, ready) -> None:
    """A reader of ``board`` (a one-tensor ``weight`` board) that waits for version ``need``."""
    import torch

    ready.set()
    board.read(torch.nn.Linear(3, 1, bias=False), need, 0)


def hold_the_lock(board, ready) -> None:
    """A reader that dies holding ``board``'s lock (the test kills it while it sleeps)."""
    import time

    board.lock.acquire()
    ready.set()
    time.sleep(600)
