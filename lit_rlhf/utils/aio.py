"""Running a reward's coroutine from the (synchronous) training loop.

An ``async def`` reward (a remote reward model, an LLM judge, a user's own) is awaited on an event
loop of its own in a background thread: :func:`start` returns at once with a future, so that the
rollout's remaining forwards run while the requests are in flight (torch releases the GIL in its
kernels), and :func:`run` waits for it. A fresh loop per call keeps no process-global state and
works whether or not the caller already runs a loop (a notebook does).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T], name: str = "lit-rlhf-reward") -> Future[T]:
    """Run ``coro`` to completion on a new event loop in a daemon thread; its result (or exception)
    arrives in the returned future."""
    future: Future[T] = Future()

    def main() -> None:
        try:
            future.set_result(asyncio.run(coro))
        except BaseException as err:  # handed to the waiting caller as it is
            future.set_exception(err)

    threading.Thread(target=main, name=name, daemon=True).start()
    return future


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, awaited on a loop of its own (see :func:`start`)."""
    return start(coro).result()
