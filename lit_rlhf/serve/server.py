"""A reward-model server: ``python -m lit_rlhf.serve --model <algo=rm's export>`` (also
``lit-rlhf serve``), for :class:`lit_rlhf.rewards.RemoteReward` and any client of OpenRLHF's
contract (docs/remote_rewards.md)::

    POST /get_reward  {"query": [...], "prompts": [...], "responses": [...], "labels": [...]}
                      → {"rewards": [...], "scores": [...]}   (same order; ``labels`` are not read)
    GET  /health      → {"status": "ok", "model": ..., "batches": ..., "rows": ..., "max_batch_rows": ...}

With ``prompts`` and ``responses`` the server tokenizes each pair with ``--template`` (the reward
model's own chat template or a named one: the template the model was trained with, as the RL
stage's in-process scorer does); with ``query`` alone (OpenRLHF's clients) each query is scored as
the text it is, plus EOS.

Dynamic batching: the rows of concurrent requests are queued and the model scores up to
``--max-batch`` rows in one forward; while other requests are still being received it waits at most
``--max-wait-ms`` for them (a lone client never waits). Forwards run in a worker thread, so requests
keep arriving while the model runs, and those queued meanwhile make the next batch. Bounds: a
request body of at most ``--max-request-mb`` and ``--max-request-rows`` rows (HTTP 413 beyond), a
request that is not the contract gets HTTP 400 naming the field. ``--token-env NAME``: requests
must carry ``Authorization: Bearer <$NAME>`` (HTTP 401 otherwise; the token is never logged).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("lit_rlhf.serve")


class BatchQueue:
    """Rows of concurrent requests scored together: :meth:`score` queues a request's rows and
    awaits their scores; :meth:`run` takes the queue's rows up to ``max_batch`` (waiting up to
    ``max_wait_s`` after the first for more while ``arriving[0]`` requests are still being read)
    and scores them with ``score_rows`` in a worker thread."""

    def __init__(
        self,
        score_rows: Callable[[list[Any], list[str]], list[float]],
        max_batch: int,
        max_wait_s: float,
        arriving: list[int],
    ):
        self.score_rows, self.max_batch, self.max_wait_s, self.arriving = score_rows, max_batch, max_wait_s, arriving
        self.queue: asyncio.Queue[tuple[list[Any], list[str], asyncio.Future]] = asyncio.Queue()
        self.batches = self.rows = self.max_rows = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="reward-forward")

    async def score(self, prompts: list[Any], responses: list[str]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(responses), self.max_batch):  # a request larger than a batch: several
            future = asyncio.get_running_loop().create_future()
            await self.queue.put((prompts[i : i + self.max_batch], responses[i : i + self.max_batch], future))
            out.extend(await future)
        return out

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            rows = len(items[0][1])
            deadline = loop.time() + self.max_wait_s
            while rows < self.max_batch:
                if self.queue.empty():
                    left = deadline - loop.time()
                    if left <= 0 or self.arriving[0] <= 0:  # nobody else is on the way: no wait
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), left)
                    except asyncio.TimeoutError:
                        break
                else:
                    item = self.queue.get_nowait()
                if rows + len(item[1]) > self.max_batch:
                    self.queue.put_nowait(item)  # goes first into the next batch (a queue of one item)
                    break
                items.append(item)
                rows += len(item[1])
            prompts = [p for item in items for p in item[0]]
            responses = [r for item in items for r in item[1]]
            try:
                scores = await loop.run_in_executor(self.executor, self.score_rows, prompts, responses)
            except Exception as err:  # the requests get a 500 naming it; the server goes on
                for *_, future in items:
                    if not future.done():
                        future.set_exception(err)
                continue
            self.batches, self.rows, self.max_rows = self.batches + 1, self.rows + rows, max(self.max_rows, rows)
            start = 0
            for p, _, future in items:
                if not future.done():
                    future.set_result(scores[start : start + len(p)])
                start += len(p)


class BadRequest(ValueError):
    pass


def read_request(body: Any, max_rows: int) -> tuple[list[Any], list[str], bool]:
    """(prompts, responses, templated) of a request body; :class:`BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with 'query' (and optionally 'prompts', 'responses')")
    if "responses" in body:
        prompts, responses = body.get("prompts"), body["responses"]
        if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
            raise BadRequest("'responses' must be a list of strings")
        if not isinstance(prompts, list) or len(prompts) != len(responses):
            raise BadRequest("'prompts' must be a list as long as 'responses'")
        templated = True
    else:
        query = body.get("query")
        if not isinstance(query, list) or not all(isinstance(q, str) for q in query):
            raise BadRequest("'query' must be a list of strings")
        prompts, responses, templated = query, [""] * len(query), False
    if len(responses) > max_rows:
        raise BadRequest(f"{len(responses)} rows; this server takes at most {max_rows} per request")
    return prompts, responses, templated


def build_app(scorer: Any, args: argparse.Namespace) -> Any:
    """The aiohttp application around ``scorer`` (a :class:`~lit_rlhf.rollout.scorers.ModelScorer`)."""
    import torch
    from aiohttp import web

    from lit_rlhf.data.chat import get_template

    plain = get_template("plain")
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        raise SystemExit(f"--token-env: the environment variable {args.token_env} is not set")

    def score_rows(prompts: list[Any], responses: list[str], template: Any) -> list[float]:
        with torch.inference_mode():
            return scorer.score_texts(prompts, responses, template=template).tolist()

    arriving = [0]  # requests being read and parsed, not queued yet (both queues wait for them)
    templated = BatchQueue(lambda p, r: score_rows(p, r, None), args.max_batch, args.max_wait_ms / 1000, arriving)
    raw = BatchQueue(lambda p, r: score_rows(p, r, plain), args.max_batch, args.max_wait_ms / 1000, arriving)

    def authorized(request: web.Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    async def get_reward(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        arriving[0] += 1
        try:
            body = json.loads(await request.read())
            prompts, responses, with_template = read_request(body, args.max_request_rows)
        except web.HTTPRequestEntityTooLarge:
            raise
        except BadRequest as err:
            status = 413 if "at most" in str(err) else 400
            return web.json_response({"error": str(err)}, status=status)
        except ValueError as err:
            return web.json_response({"error": f"the body is not JSON: {err}"}, status=400)
        finally:
            arriving[0] -= 1
        try:
            scores = await (templated if with_template else raw).score(prompts, responses)
        except Exception as err:
            log.error("scoring failed: %s: %s", type(err).__name__, err)
            return web.json_response({"error": f"scoring failed: {type(err).__name__}: {err}"}, status=500)
        return web.json_response({"rewards": scores, "scores": scores})

    async def health(request: web.Request) -> web.Response:
        stats = {
            "batches": templated.batches + raw.batches,
            "rows": templated.rows + raw.rows,
            "max_batch_rows": max(templated.max_rows, raw.max_rows),
        }
        return web.json_response({"status": "ok", "model": os.path.basename(os.path.normpath(args.model)), **stats})

    async def start_workers(app: web.Application) -> Any:
        tasks = [asyncio.create_task(q.run()) for q in (templated, raw)]
        yield
        for t in tasks:
            t.cancel()
        for q in (templated, raw):
            q.executor.shutdown(wait=False)

    app = web.Application(client_max_size=int(args.max_request_mb * 2**20))
    app.router.add_post("/get_reward", get_reward)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(start_workers)
    return app


def load_scorer(args: argparse.Namespace) -> Any:
    """The reward model of ``--model`` and its tokenizer, frozen, as a scorer of texts."""
    import torch

    from lit_rlhf.data.chat import get_template, has_chat_template
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import freeze
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.scorers import ModelScorer

    rm = freeze(load_reward_model(args.model, dtype=args.dtype)).eval().to(torch.device(args.device))
    tok = build_tokenizer(ModelSpec(name_or_path=args.model, kind=rm.kind))
    name = args.template or ("auto" if has_chat_template(tok) else "plain")
    return ModelScorer(rm, tok, tok, get_template(name), args.max_length)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lit-rlhf serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a reward-model folder (algo=rm's export_dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5000, help="0: a free port (printed)")
    p.add_argument("--template", default=None, help="auto, plain, chatml, … (default: auto if the tokenizer has one)")
    p.add_argument(
        "--max-length", type=int, default=1024, help="tokens per pair (longer prompts are cut from the left)"
    )
    p.add_argument("--max-batch", type=int, default=32, help="rows per forward")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="wait for more rows after the first")
    p.add_argument("--max-request-rows", type=int, default=4096)
    p.add_argument("--max-request-mb", type=float, default=64.0)
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    p.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    args = p.parse_args(argv)
    for key in ("max_length", "max_batch", "max_request_rows"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.max_wait_ms < 0 or args.max_request_mb <= 0:
        p.error("--max-wait-ms must be >= 0 and --max-request-mb > 0")
    return args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from lit_rlhf.rewards.http import aiohttp_module
    from lit_rlhf.utils.errors import UserError

    try:
        aiohttp_module()
        scorer = load_scorer(args)
    except UserError as err:
        sys.exit(f"Error: {err}")
    from aiohttp import web

    app = build_app(scorer, args)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)  # request lines are not worth a log line each
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"lit_rlhf.serve: {args.model} on http://{args.host}:{port}/get_reward", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
