"""Rewards behind HTTP (``reward_server``): lit_rlhf's GRPO with the bench reward model in-process
(``algo.reward_path``) and behind ``python -m lit_rlhf.serve`` on 127.0.0.1 (``RemoteReward``, the same
model), in one process one after the other; how much of the remote scoring the rollout's reference
forward hides (the time the trainer blocks on the scores against the request's latency); and the
server's throughput in pairs/s for requests of 1 to 64 rows sent one at a time."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import median_step, step_timer
from .grpo import _grpo_ours

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def start_server(rm: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    """The reward server of ``rm`` on a free port (one thread), and its URL."""
    import os

    cmd = [sys.executable, "-m", "lit_rlhf.serve", "--model", str(rm), "--port", "0", "--template", "plain"]
    cmd += ["--max-batch", str(max_batch), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if "/get_reward" in line:
            return proc, line.split(" on ")[-1].strip()
    raise RuntimeError(f"the reward server exited with {proc.wait()}")


def _grpo_steps(models: Path, s: dict, reward: dict, instrument=None) -> float:
    timer = step_timer()
    callbacks = [timer] + ([instrument] if instrument is not None else [])
    trainer, module, data = _grpo_ours(models, s, s["warmup"] + s["steps"], callbacks, reward=reward)
    start = time.perf_counter()
    trainer.fit(module, data)
    return median_step([start] + timer.times, s["warmup"])


def _throughput(url: str, rows: list[tuple[str, str]], batches: tuple[int, ...], repeats: int) -> dict[int, float]:
    import aiohttp

    from lit_rlhf.utils import aio

    async def measure() -> dict[int, float]:
        out = {}
        async with aiohttp.ClientSession() as session:
            for b in batches:
                body = {"prompts": [p for p, _ in rows[:b]], "responses": [r for _, r in rows[:b]]}
                async with session.post(url, json=body) as resp:  # warm-up
                    await resp.read()
                start = time.perf_counter()
                for _ in range(repeats):
                    async with session.post(url, json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                out[b] = b * repeats / (time.perf_counter() - start)
        return out

    return aio.run(measure())


def case_reward_server(models: Path, s: dict) -> dict:
    import lightning.pytorch as pl

    from lit_rlhf.data.synthetic import SyntheticTask

    local_s = _grpo_steps(models, s, {"reward_path": str(models / "rm")})
    batches = BATCHES if s["steps"] > 1 else (1, 4)
    proc, url = start_server(models / "rm", max(batches))
    try:
        latency, blocked = [], []

        class Instrument(pl.Callback):
            """Times the remote call (in its thread) and the trainer's wait for its scores."""

            def on_train_start(self, trainer, module):
                scorer = module.scorer
                fn, submit = scorer.fn, scorer.submit

                async def timed(*args, **kwargs):
                    t0 = time.perf_counter()
                    out = await fn(*args, **kwargs)
                    latency.append(time.perf_counter() - t0)
                    return out

                def timed_submit(*args, **kwargs):
                    pending = submit(*args, **kwargs)

                    def wait():
                        t0 = time.perf_counter()
                        out = pending()
                        blocked.append(time.perf_counter() - t0)
                        return out

                    return wait

                scorer.fn, scorer.submit = timed, timed_submit

        remote = {"reward_fn": {"_target_": "lit_rlhf.rewards.RemoteReward", "urls": url, "timeout_s": 600}}
        remote_s = _grpo_steps(models, s, remote, Instrument())
        task = SyntheticTask()
        rows = [(r["prompt"], r["prompt"][::-1]) for r in task.prompts(max(batches), "test")]
        pairs = _throughput(url, rows, batches, repeats=max(2, 2 * s["steps"]))
    finally:
        proc.terminate()
        proc.wait(30)
    lat, wait = statistics.median(latency[s["warmup"] :]), statistics.median(blocked[s["warmup"] :])
    return {
        "local_step_s": local_s,
        "remote_step_s": remote_s,
        "remote_over_local": local_s / remote_s,
        "latency_s": lat,
        "blocked_s": wait,
        "hidden": max(0.0, 1 - wait / lat) if lat > 0 else None,
        "pairs_per_s": {str(b): v for b, v in pairs.items()},
    }
