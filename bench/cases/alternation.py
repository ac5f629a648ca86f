"""Two training loops of one process taking turns step by step (the paired GRPO measurement)."""

from __future__ import annotations

import threading
import time


class Alternation:
    """Two training loops of one process taking turns, one step each: ``step(side)`` at the start
    of each of ``side``'s steps hands the turn to the other loop and waits for it back (the first
    call waits until both loops have set up), so only one loop computes at any time, and each
    loop's cycle (its step and the loop's own overhead up to its next step) is timed alone.
    ``finish(side)`` when a loop ends: the other then runs on without waiting. Adjacent cycles
    of the two loops, a second or so apart, share the machine's state: on a VM whose speed drifts
    over seconds their ratio is a much steadier measurement than runs minutes apart."""

    def __init__(self, first: str, second: str, timeout: float = 900.0) -> None:
        self.sides, self.turn, self.timeout = (first, second), first, timeout
        self.cond = threading.Condition()
        self.ready: set[str] = set()
        self.done: set[str] = set()
        self.holder: str | None = None
        self.started = 0.0
        self.cycles: dict[str, list[float]] = {first: [], second: []}

    def _other(self, side: str) -> str:
        return self.sides[1] if side == self.sides[0] else self.sides[0]

    def _release(self, side: str, now: float, record: bool) -> None:
        if self.holder == side:
            if record:
                self.cycles[side].append(now - self.started)
            self.holder, self.turn = None, self._other(side)

    def step(self, side: str) -> None:
        now = time.perf_counter()
        other = self._other(side)
        with self.cond:
            self._release(side, now, record=True)
            self.ready.add(side)
            self.cond.notify_all()
            mine = lambda: other in self.done or (len(self.ready) == 2 and self.turn == side)  # noqa: E731
            if not self.cond.wait_for(mine, self.timeout):
                raise TimeoutError(f"{side}: the other loop ({other}) kept the turn for {self.timeout:.0f} s")
            self.holder, self.started = side, time.perf_counter()

    def finish(self, side: str) -> None:
        with self.cond:
            self._release(side, time.perf_counter(), record=False)  # the last cycle holds the loop's teardown
            self.done.add(side)
            self.turn = self._other(side)
            self.cond.notify_all()

    def pairs(self, warmup: int) -> list[tuple[float, float]]:
        """(first's cycle, second's cycle) of each round after ``warmup``; first's ran just before."""
        a, b = self.cycles[self.sides[0]], self.cycles[self.sides[1]]
        return list(zip(a, b))[warmup:]
