"""The HTTP side of remote rewards (docs/remote_rewards.md): a pool of endpoints, the retry and failure
policy, and token-bucket rate limits. :mod:`lit_rlhf.rewards.remote` (a reward-model server) and
:mod:`lit_rlhf.rewards.judge` (an LLM judge) send their requests through :meth:`EndpointPool.post`.

The policy, per request:

* **connection refused / reset** (nothing listens): the endpoint is *down*; the request moves to the
  next endpoint at once, without using a retry. A down endpoint is probed again after a capped
  exponential backoff and is *up* again with its first answer.
* **every endpoint down**: requests wait (probing) instead of failing; once all of them have been
  down for ``give_up_after_s`` the pool raises :class:`RewardServiceDown` — the RL stage turns that
  into a clean stop after a checkpoint (``ckpt_path=last`` resumes).
* **an answer that can be retried** (HTTP 408, 429 — after its ``Retry-After`` —, 5xx, a body that
  is not the expected JSON, a timeout, a connection dropped mid-answer): retried up to
  ``retries`` times with capped exponential backoff, on the next endpoint; after the last retry
  the request has no scores (the rows become NaN: left out of the update, counted as errors).
* **any other 4xx** (a wrong path, a bad token, a body too large): :class:`RemoteRewardError` at
  once, naming the endpoint and status — a configuration error, not bad luck.

URLs are shown without their user-info and query (where credentials hide); the bearer token is read
from an environment variable and never enters a config, a log or an error message.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from lit_rlhf.utils.errors import UserError


class RemoteRewardError(UserError, RuntimeError):
    """A reward endpoint refused the request for a reason retrying cannot fix (HTTP 4xx), or the
    remote reward's settings are wrong."""


class RewardServiceDown(UserError, RuntimeError):
    """Every reward endpoint stayed unreachable for longer than ``give_up_after_s``."""


class Malformed(ValueError):
    """An answer whose body is not what the endpoint's contract promises (retried)."""


def aiohttp_module() -> Any:
    """aiohttp (the ``serve`` extra), or a clear error saying how to install it."""
    try:
        import aiohttp
    except ImportError as err:
        raise RemoteRewardError("remote rewards need aiohttp: pip install 'lit_rlhf[serve]'") from err
    return aiohttp


def shown_url(url: str) -> str:
    """``url`` without user-info, query and fragment: safe to log."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def shown_urls(urls: str | Sequence[str]) -> str:
    """A comma-separated list or a list of URLs, each as :func:`shown_url` shows it."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return ", ".join(shown_url(u.strip()) for u in items if u.strip())


def parse_urls(urls: str | Sequence[str], default_path: str) -> list[str]:
    """``"http://a:1,http://b:2"`` or a list → absolute URLs; an empty path becomes ``default_path``."""
    items = [u.strip() for u in (urls.split(",") if isinstance(urls, str) else urls)]
    items = [u for u in items if u]
    if not items:
        raise RemoteRewardError("urls: no endpoint given (one URL, a comma-separated list or a list)")
    out = []
    for url in items:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteRewardError(f"urls: {shown_url(url)!r} is not an http(s)://host[:port][/path] URL")
        out.append(url if parts.path not in ("", "/") else urlunsplit(parts._replace(path=default_path)))
    return out


class TokenBucket:
    """At most ``per_minute`` units a minute: a bucket of one second's worth (at least one unit)
    refilled continuously. A request larger than the bucket waits for a full bucket and leaves a
    debt, so the average rate holds for any request size. ``clock``/``sleep`` are injectable."""

    def __init__(self, per_minute: float, clock: Callable[[], float], sleep: Callable[[float], Awaitable[Any]]):
        if not per_minute > 0:
            raise RemoteRewardError(f"a rate limit must be > 0 per minute, got {per_minute}")
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate)
        self.level = self.capacity
        self.clock, self.sleep = clock, sleep
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    async def acquire(self, units: float, lock: asyncio.Lock) -> None:
        async with lock:  # first come, first served
            self._refill()
            need = min(units, self.capacity)
            while self.level < need:
                await self.sleep((need - self.level) / self.rate)
                self._refill()
            self.level -= units


@dataclass
class Endpoint:
    url: str
    down_since: float | None = None
    retry_at: float = 0.0
    failures: int = 0

    @property
    def shown(self) -> str:
        return shown_url(self.url)


@dataclass
class CallStats:
    """What one scoring call went through (for ``reward/<name>_errors`` and the logs)."""

    retries: int = 0
    failed_requests: int = 0
    example: str | None = None
    outage: str | None = None
    problems: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.failed_requests += 1
        self.example = self.example or message


class EndpointPool:
    """The endpoints of one remote reward, their up/down state (kept across calls), the retry
    policy and the rate limits (module docstring)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_backoff_s: float,
        give_up_after_s: float,
        max_concurrent: int,
        max_rpm: float | None,
        max_tpm: float | None,
        token_env: str | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ):
        for key, value, low in (
            ("timeout_s", timeout_s, 0),
            ("backoff_s", backoff_s, 0),
            ("max_backoff_s", max_backoff_s, 0),
            ("give_up_after_s", give_up_after_s, 0),
        ):
            if not (isinstance(value, (int, float)) and value > low):
                raise RemoteRewardError(f"{key} must be a number > {low}, got {value!r}")
        if not (isinstance(retries, int) and retries >= 0):
            raise RemoteRewardError(f"retries must be an integer >= 0, got {retries!r}")
        if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
            raise RemoteRewardError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        if token_env is not None and not os.environ.get(token_env):
            raise RemoteRewardError(f"token_env: the environment variable {token_env} (the bearer token) is not set")
        aiohttp_module()  # at build time, not at the first scoring
        self.endpoints = [Endpoint(u) for u in urls]
        self.timeout_s, self.retries = float(timeout_s), retries
        self.backoff_s, self.max_backoff_s, self.give_up_after_s = (
            float(backoff_s),
            float(max_backoff_s),
            give_up_after_s,
        )
        self.max_concurrent, self.token_env = max_concurrent, token_env
        self.clock, self.sleep = clock, sleep
        self.request_bucket = TokenBucket(max_rpm, clock, sleep) if max_rpm else None
        self.token_bucket = TokenBucket(max_tpm, clock, sleep) if max_tpm else None

    def names(self) -> str:
        return ", ".join(e.shown for e in self.endpoints)

    def session(self) -> Any:
        """An aiohttp session for one call (a fresh event loop each call: lit_rlhf/utils/aio.py)."""
        aiohttp = aiohttp_module()

        headers = {"Authorization": f"Bearer {os.environ[self.token_env]}"} if self.token_env else {}
        limits = aiohttp.TCPConnector(limit=self.max_concurrent)
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=headers, connector=limits
        )

    def call_state(self) -> tuple[asyncio.Semaphore, asyncio.Lock, asyncio.Lock]:
        """The per-call concurrency bound and the buckets' locks (bound to the call's loop)."""
        return asyncio.Semaphore(self.max_concurrent), asyncio.Lock(), asyncio.Lock()

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, attempt - 1))

    def mark_down(self, ep: Endpoint) -> None:
        now = self.clock()
        ep.down_since = now if ep.down_since is None else ep.down_since
        ep.failures += 1
        ep.retry_at = now + self.backoff(ep.failures)

    @staticmethod
    def mark_up(ep: Endpoint) -> None:
        ep.down_since, ep.failures, ep.retry_at = None, 0, 0.0

    async def available(self, prefer: int) -> Endpoint:
        """The first endpoint from ``prefer`` on that is up or due for a probe; waits while all are
        down; raises :class:`RewardServiceDown` once all have been down for ``give_up_after_s``."""
        n = len(self.endpoints)
        while True:
            now = self.clock()
            for j in range(n):
                ep = self.endpoints[(prefer + j) % n]
                if ep.down_since is None or ep.retry_at <= now:
                    return ep
            all_down_since = max(e.down_since for e in self.endpoints if e.down_since is not None)
            give_up_at = all_down_since + self.give_up_after_s
            if now >= give_up_at:
                raise RewardServiceDown(
                    f"every reward endpoint has been unreachable for {now - all_down_since:.0f} s "
                    f"(give_up_after_s={self.give_up_after_s:g}): {self.names()}"
                )
            await self.sleep(max(0.0, min(min(e.retry_at for e in self.endpoints), give_up_at) - now))

    async def post(
        self,
        session: Any,
        payload: dict[str, Any],
        *,
        prefer: int,
        tokens: float,
        check: Callable[[Any], Any],
        state: tuple[asyncio.Semaphore, asyncio.Lock, asyncio.Lock],
        stats: CallStats,
    ) -> Any:
        """``check(json body)`` of the first good answer to ``payload``, or None after the last retry
        (counted in ``stats``). ``check`` raises :class:`Malformed` for a body it cannot use."""
        aiohttp = aiohttp_module()

        semaphore, request_lock, token_lock = state
        n, attempt = len(self.endpoints), 0
        while True:
            ep = await self.available(prefer)
            retry_after: float | None = None
            try:
                async with semaphore:
                    if self.request_bucket is not None:
                        await self.request_bucket.acquire(1, request_lock)
                    if self.token_bucket is not None:
                        await self.token_bucket.acquire(tokens, token_lock)
                    async with session.post(ep.url, json=payload) as resp:
                        status, body = resp.status, await resp.read()
                        retry_after = _seconds(resp.headers.get("Retry-After"))
            except aiohttp.ClientConnectorError:
                self.mark_down(ep)  # nothing listens there: try the next one, no retry used
                prefer = (self.endpoints.index(ep) + 1) % n
                continue
            except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
                problem = f"no answer within timeout_s={self.timeout_s:g}"
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as err:
                self.mark_down(ep)
                problem = f"connection lost ({type(err).__name__})"
            else:
                self.mark_up(ep)
                if status == 200:
                    try:
                        return check(json.loads(body))
                    except (Malformed, ValueError) as err:  # json.JSONDecodeError is a ValueError
                        problem = f"malformed answer: {str(err)[:200]}"
                elif status in (408, 429) or status >= 500:
                    problem = f"HTTP {status}: {_snippet(body)}"
                else:
                    hint = " (lower batch_size)" if status == 413 else ""
                    hint = " (check token_env)" if status in (401, 403) else hint
                    raise RemoteRewardError(
                        f"reward endpoint {ep.shown} answered HTTP {status}{hint}: {_snippet(body)}"
                    )
            attempt += 1
            if attempt > self.retries:
                stats.fail(f"{ep.shown}: {problem} (after {self.retries} retries)")
                return None
            stats.retries += 1
            stats.problems.append(f"{ep.shown}: {problem}")
            await self.sleep(min(self.max_backoff_s, retry_after) if retry_after is not None else self.backoff(attempt))
            prefer = (self.endpoints.index(ep) + 1) % n


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: use the backoff


def _snippet(body: bytes) -> str:
    return body[:200].decode("utf-8", "replace").strip() or "(empty body)"


def numbers(values: Any, n: int, what: str) -> list[float]:
    """``values`` as ``n`` floats, or :class:`Malformed` saying why not."""
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise Malformed(f"{what}: expected a list of {n} numbers, got {got}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Malformed(f"{what}: {v!r} is not a number")
        out.append(float(v))
    return out


def estimate_tokens(texts: Sequence[str]) -> float:
    """Tokens of ``texts`` for the tokens-per-minute limit: ≈ 4 characters per token."""
    return float(sum(math.ceil(len(t) / 4) for t in texts)) or 1.0
