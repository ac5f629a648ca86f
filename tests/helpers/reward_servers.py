"""Small HTTP reward servers on 127.0.0.1 for the remote-reward tests: each runs an aiohttp app on
its own event loop in a daemon thread, answers OpenRLHF's ``POST /get_reward`` with a behaviour the
test sets (and changes while it runs), and can stop (connection refused) and start again on the
same port (an endpoint that dies and comes back)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web


def length_score(payload: dict[str, Any]) -> list[float]:
    """The deterministic score the fault servers give: the response's length in characters."""
    return [float(len(r)) for r in payload["responses"]]


class FaultServer:
    """``behaviour(payload, n)`` → ``(status, body bytes or JSON-able, delay_s)`` for the n-th request
    (from 0) to ``path``; the default answers ``{"rewards": length_score}`` at once. ``requests`` keeps every
    payload received, ``served`` the number answered with 200."""

    def __init__(
        self,
        behaviour: Callable[[dict[str, Any], int], tuple[int, Any, float]] | None = None,
        path: str = "/get_reward",
    ):
        self.behaviour = behaviour or (lambda payload, n: (200, {"rewards": length_score(payload)}, 0.0))
        self.path = path
        self.requests: list[dict[str, Any]] = []
        self.served = 0
        self.port = 0
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        with self._lock:
            n = len(self.requests)
            self.requests.append(payload)
            self.headers.append(dict(request.headers))
        status, body, delay = self.behaviour(payload, n)
        if delay:
            await asyncio.sleep(delay)
        if status == 200 and not isinstance(body, bytes):
            self.served += 1
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return web.Response(status=status, body=data, content_type="application/json")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post(self.path, self._handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]  # the port the OS chose (first start)

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def stop(self) -> None:
        """Close the listening socket: connections are refused until :meth:`start`."""
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
            self.runner = None

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
