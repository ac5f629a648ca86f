"""Asynchronous rollouts: a producer process samples the rollouts of the coming RL iterations while
the trainer trains (``algo.rollout.mode=async``; docs/async.md).

The trainer (lit_rlhf/modules/rl.py) hands the producer the prompts of iteration ``k`` and of the
iterations ahead, as the prompt loader looks ahead (lit_rlhf/data/loader.py ``lookahead``); each is
a *ticket*, numbered by the iteration that will train on it. The producer samples the tickets in
order through the one rollout path (rollout/collect.py ``sample_responses``: the hf loop or a vLLM
engine, one turn or multi-turn with the run's environment) with its own copy of the policy. Its weights come from a
:class:`WeightBoard`, one shared-memory copy of the trained tensors that the trainer overwrites
after every RL iteration, stamped with the iteration's number (the *policy version*). Under ZeRO-3
and FSDP, whose ranks hold shards, the trainer gathers the whole weights for it
(:func:`trained_tensors`) and the producer's copy is a plain model of the policy's config
(:func:`policy_replica`).

**The bound.** Ticket ``k`` may only be sampled with a version ≥ ``k − max_staleness``: the
producer waits for it (and takes the newest version there is when it starts the ticket), and the
trainer hands out no ticket beyond ``k + max_staleness``. So no finished rollout is ever too old to
be trained on, none is thrown away, and a slow rollout holds the trainer back instead of being
dropped. Each delivered rollout carries its version; ``k − version`` is its staleness.

**Merged batches** (``algo.rollout.merge_rollouts``): a producer that is behind, with several
tickets admitted by the version it read, samples them as one batch and delivers each ticket's rows
cut to its own width (lit_rlhf/rollout/merge.py).

**Bound 0** is the synchronous run in another process: ticket ``k`` is sampled with version ``k``
(the weights after iteration ``k − 1``) and with the trainer's random state, handed over with the
ticket and handed back with the rollout. At a bound above 0 each batch samples from its first ticket's own
seed (the run's seed and the ticket): a resumed run samples each ticket with the same random
numbers where it merges the same tickets.

**Faults.** A producer that dies is started again (``algo.rollout.restarts`` times in a run) and
samples its unfinished tickets again; then the run stops with an error naming the key. A producer
whose trainer died (SIGKILL) is killed with it, mid-sample too (:func:`_watch_trainer`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from lit_rlhf.rollout.agent import total_counts
from lit_rlhf.rollout.collect import rollout_inputs, sample_responses, scored_logprobs
from lit_rlhf.rollout.merge import mergeable, merged_batch, merged_prompt_limit, prompt_tokens, split_sample
from lit_rlhf.utils.compat.torch import set_num_threads
from lit_rlhf.utils.rng import capture_rng, restore_rng, rng_kept

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a waiting trainer looks again at the producer's health (and a publisher at a board
lock that a dead reader may hold)."""
BOARD_POLL_S = 0.005
"""How often a producer that waits for a version looks at the board again."""


PRELOAD = ("lit_rlhf.rollout.producer", "lit_rlhf.rollout.collect", "transformers")
"""What the fork server imports once, before it forks a producer."""


class ProducerError(RuntimeError):
    """The producer failed: its exception, or it died more often than ``algo.rollout.restarts``;
    ``key``: the config key of a configuration error the producer met (raised as a ConfigError)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> Any:
        return ProducerError, (str(self), self.key)


@dataclass
class Ticket:
    """One rollout to sample: the prompts of the RL iteration ``ticket`` (as the loader collates
    them), the oldest policy version allowed, and the trainer's random state at bound 0."""

    ticket: int
    batch: dict[str, Any]
    need: int
    rng: dict[str, Any] | None = None


@dataclass
class Drawn:
    """A sampled ticket: ``sample_responses``' output (``drawn``), the policy version that sampled
    it, the reference's log-probs of its first rows (``reference_share`` of them; None: none), the
    random state after sampling (bound 0), and the producer's timings and statistics (``merged``:
    the rollouts sampled in its batch, rollout/merge.py)."""

    ticket: int
    version: int
    drawn: tuple
    ref_logprobs: torch.Tensor | None
    rng: dict[str, Any] | None
    sample_s: float
    weights_wait_s: float
    agent_counts: dict[str, int] = field(default_factory=dict)
    reference_share: float = 0.0
    merged: int = 1


@dataclass
class ProducerSettings:
    """What the producer samples with: the run's sampling settings (``gen.engine``: the hf loop or a
    vLLM engine of the producer's own) and responses per prompt, the log-prob temperature of the
    sampler's log-probs (None: not kept), the multi-turn settings (None: one turn), the frozen
    reference that scores each sample where it is drawn (None: the trainer scores; its memory is
    shared with the trainer's, never copied) at the trainer's log-prob temperature and forward, the
    vLLM engine's log-prob mode, the seed of the tickets at a bound above 0, its torch threads, the
    most tickets it samples as one batch (``algo.rollout.merge_rollouts``), and a test's delay
    (``ticket -> seconds`` slept before sampling; a picklable function). ``reference_scoring``
    (with a reference): ``producer`` scores every row of every sample; ``balanced`` the share of
    rows that evens out the two sides' busy time (:class:`ReferenceShare`; the trainer scores the rest).
    ``device``: where the producer samples and scores, the trainer's own (the CPU, or the rank's
    GPU); ``autocast``: the dtype of the trainer's autocast there during its training step (its
    ``bf16-mixed`` precision; None: none), under which the producer samples and scores too, as the
    synchronous rollout does inside the training step."""

    gen: Any
    responses_per_prompt: int
    logprob_temperature: float | None
    agent: Any = None
    reference: nn.Module | None = None
    score_temperature: float = 1.0
    padding_free: bool = False
    reference_scoring: str = "producer"
    vllm_logprobs: str = "raw_logprobs"
    seed: int = 0
    threads: int = 1
    merge_rollouts: int = 1
    delay: Callable[[int], float] | None = None
    device: str = "cpu"
    autocast: torch.dtype | None = None


class WeightBoard:
    """The trained weights the producer reads: one shared-memory copy of each tensor of
    :func:`trained_tensors` in CPU memory (wherever the trainer's are), the version they are (the RL
    iterations done), and a publication count; one lock for writes and reads, so a reader never
    sees half of a version. A reader that waits for a
    version polls the board instead of sleeping on a condition: a ``multiprocessing.Condition``
    whose sleeper was killed makes the next ``notify`` wait for it forever."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int, ctx: Any) -> None:
        self.names = list(tensors)
        self.tensors = {n: t.detach().to("cpu", copy=True).share_memory_() for n, t in tensors.items()}
        self.version = ctx.Value("q", version, lock=False)
        self.serial = ctx.Value("q", 1, lock=False)
        self.lock = ctx.Lock()

    def publish(self, tensors: dict[str, torch.Tensor], version: int, alive: Callable[[], bool]) -> bool:
        """Copy ``tensors`` in as ``version`` (a producer that waits for it sees it at its next look);
        False when the lock stays taken by a reader that is no longer ``alive()`` (killed mid-copy)."""
        while not self.lock.acquire(timeout=POLL_S):
            if not alive():
                return False
        try:
            with torch.no_grad():
                for n in self.names:
                    self.tensors[n].copy_(tensors[n])
            self.version.value = version
            self.serial.value += 1
        finally:
            self.lock.release()
        return True

    def read(self, model: nn.Module, need: int, serial: int) -> tuple[int, int]:
        """Wait for a version ≥ ``need``, copy the newest into ``model`` unless it is the publication
        ``serial`` it already holds; returns (version, serial). (A producer whose trainer is gone is
        killed while it waits: :func:`_watch_trainer`.)"""
        while True:
            with self.lock:
                if self.version.value >= need:
                    if self.serial.value != serial:
                        params = dict(model.named_parameters())
                        with torch.no_grad():
                            for n in self.names:
                                params[n].copy_(self.tensors[n])
                    return int(self.version.value), int(self.serial.value)
            time.sleep(BOARD_POLL_S)


def trained_tensors(model: nn.Module, whole: bool) -> dict[str, torch.Tensor]:
    """What the producer's copy of the policy takes from the trainer after each RL iteration. Where
    every rank holds whole weights (``whole``: one process, DDP, ZeRO-1/2): the trainable parameters
    (the frozen ones never change and the copy has them). Under ZeRO-3 and FSDP, called inside the
    module's gathered sampling context: every weight under its checkpoint name, LoRA merged, as the
    colocated vLLM engine loads them (rollout/vllm_engine.py ``policy_weights``); the copy is then a
    plain model of the policy's config (:func:`policy_replica`)."""
    if whole:
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    from lit_rlhf.rollout.vllm_engine import policy_weights

    return policy_weights(model, engine_modules=set())  # a tied weight once, as the copy holds it


def policy_replica(model: nn.Module, weights: dict[str, torch.Tensor], whole: bool) -> nn.Module:
    """The producer's copy of the policy, in CPU memory and eval mode, *hollow*: each parameter that
    ``weights`` (the board's tensors) holds is an empty placeholder, to which the producer gives
    memory of its own on its device (:func:`own_weights`) before it reads the board into it. So the
    copy on its way to the producer (through shared memory) holds only what the board does not: a
    LoRA policy's frozen base, the buffers. ``whole``: a deep copy, adapters and all (a copy:
    pickling shares a module's memory with the child, which must not be the trained tensors), made
    tensor by tensor into CPU memory (no second copy on the GPU). Under ZeRO-3/FSDP, whose
    parameters are shards: a model of the policy's Hugging Face class and config, whose every
    parameter the board overwrites; a board weight it has no parameter for is refused."""
    import copy

    if whole:
        names = {id(p): n for n, p in model.named_parameters()}
        memo: dict[int, Any] = {}
        for t in model.buffers():
            memo[id(t)] = t.detach().to("cpu", copy=True)
        for p in model.parameters():
            held = names[id(p)] in weights  # on the board: the producer allocates it
            data = torch.empty(0, dtype=p.dtype) if held else p.detach().to("cpu", copy=True)
            memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
        return copy.deepcopy(model, memo).cpu().eval()
    from transformers import PreTrainedModel

    from lit_rlhf.utils.config import ConfigError

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        raise ConfigError(
            "algo.rollout.mode",
            f"async rollouts under ZeRO-3/FSDP copy a Hugging Face policy; {type(model).__name__} is none",
        )
    dtype = next(iter(weights.values())).dtype
    with rng_kept():  # its initialization draws nothing from the trainer's random state
        replica = type(hf)(hf.config).to(dtype).eval().requires_grad_(False)
    names = {n for n, _ in replica.named_parameters()}
    missing = sorted(set(weights) - names)
    if missing or names - set(weights):
        raise ConfigError(
            "algo.rollout.mode",
            f"async rollouts under ZeRO-3/FSDP: the policy's weights {missing[:3] or sorted(names - set(weights))[:3]} "
            f"do not match a fresh {type(hf).__name__}'s parameters; use algo.rollout.mode=sync",
        )
    for p in replica.parameters():  # every one is on the board
        p.data = torch.empty(0, dtype=p.dtype)
    return replica


def own_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Give each hollow parameter of the producer's copy (:func:`policy_replica`) memory of its own,
    where the parameter is (the producer's device), shaped as its board tensor in ``weights``; the
    board's first read then fills it (a parameter that is not hollow keeps its memory: where its
    shape differs from the board's, that read refuses it)."""
    for n, p in model.named_parameters():
        if n in weights and p.numel() == 0 and weights[n].numel() > 0:
            p.data = torch.empty(weights[n].shape, dtype=p.dtype, device=p.device)


def moved(obj: Any, device: torch.device | str, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``obj`` with every tensor in it detached and on ``device`` (through dicts, lists, tuples and
    dataclasses, as :func:`sample_responses`' output holds them; a tensor held twice is moved once):
    what crosses between the trainer and the producer goes through CPU memory, and each side moves
    it to its own device."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to(device)
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {k: moved(v, device, memo) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(moved(v, device, memo) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(v, device, memo) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: moved(getattr(obj, f.name), device, memo) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


def _watch_trainer(lifeline: Any, trainer: int) -> None:
    """Kill this process as soon as the trainer that started it is gone, even mid-sample or waiting
    for weights: a thread waits on ``lifeline``, the read end of a pipe whose write end the trainer
    holds (the kernel closes it when the trainer dies, SIGKILL included), and, where Linux has them,
    on a pidfd of the ``trainer`` process, readable when it exits. The pipe alone can outlive the
    trainer: a process it forks after starting the producer (a DataLoader worker) holds a copy of
    the write end until it exits too."""
    import threading
    from multiprocessing.connection import wait

    try:
        pidfd = os.pidfd_open(trainer)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+): the pipe alone
        pidfd = None

    def watch() -> None:
        try:
            while pidfd not in wait([lifeline] + ([pidfd] if pidfd is not None else [])):
                lifeline.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lit_rlhf-trainer-watch", daemon=True).start()


def _produce(
    model: nn.Module,
    tokenizer: Any,
    settings: ProducerSettings,
    board: WeightBoard,
    jobs: Any,
    out: Any,
    lifeline: Any,
    trainer_wait: Any,
    trainer: int,
) -> None:
    """The producer process: sample the tickets of ``jobs`` in order into ``out`` until a None;
    ``trainer_wait``: the trainer's recent wait for a rollout, shared (:func:`_recent`); ``trainer``:
    its pid (:func:`_watch_trainer`)."""
    from lit_rlhf.rollout.vllm_engine import engine_for

    _watch_trainer(lifeline, trainer)
    set_num_threads(settings.threads)
    device = torch.device(settings.device)
    if device.type == "cuda":
        device = _own_gpu(device, settings.gen.engine)
    if settings.gen.engine == "hf":  # the copy samples there; a vLLM engine there loads it from CPU memory
        model.to(device)
    own_weights(model, board.tensors)  # the board's first read fills them
    agent = None
    if settings.agent is not None:
        from lit_rlhf.rollout.agent import AgentLoop

        agent = AgentLoop(settings.agent)
    model.eval()
    # the training step's autocast (bf16-mixed), for the sampling and the reference's scoring
    autocast = functools.partial(torch.autocast, device.type, settings.autocast, enabled=settings.autocast is not None)
    share = ReferenceShare(balanced=settings.reference_scoring == "balanced")
    held: collections.deque = collections.deque()  # tickets taken off the queue, not sampled yet
    longest = merged_prompt_limit(model, settings.gen, settings.agent)
    serial, engine, idle, idle_since = 0, None, 0.0, time.perf_counter()
    try:
        while True:
            job = _next_ticket(jobs, held)
            if job is None:
                return
            started = time.perf_counter()
            version, serial = board.read(model, job.need, serial)
            group = [job, *_admitted(jobs, held, job, version, settings.merge_rollouts - 1, longest)]
            if settings.gen.engine != "hf":  # synced to the board's weights as the colocated engine is
                engine = engine_for(model, settings.gen, serial, engine, settings.vllm_logprobs, device.type)
            sampling = time.perf_counter()
            if settings.delay is not None:
                time.sleep(sum(settings.delay(j.ticket) for j in group))
            rows = [len(j.batch["prompts"]) * settings.responses_per_prompt for j in group]
            with autocast():
                drawn = _sample(model, tokenizer, group, settings, engine, agent, device)
            parts = split_sample(drawn, rows) if len(group) > 1 else [drawn]
            sampled_s = time.perf_counter() - sampling
            for j, part, n in zip(group, parts, rows):
                idle = _recent(idle, (sampling - idle_since) / len(group))  # per rollout
                scoring = time.perf_counter()
                with autocast():
                    ref, scored = _reference_rows(part, settings, share, idle, trainer_wait.value)
                out.put(
                    Drawn(
                        ticket=j.ticket,
                        version=version,
                        drawn=moved(part, "cpu"),
                        ref_logprobs=moved(ref, "cpu"),
                        rng=capture_rng() if j.rng is not None else None,
                        sample_s=sampled_s * n / sum(rows) + time.perf_counter() - scoring,
                        weights_wait_s=sampling - started if j is job else 0.0,
                        agent_counts=total_counts(part[2].counts) if agent is not None else {},
                        reference_share=scored,
                        merged=len(group),
                    )
                )
            idle_since = time.perf_counter()
    except SystemExit:
        return
    except BaseException as err:  # the trainer raises it (a config error as itself, naming its key)
        from lit_rlhf.utils.config import ConfigError

        log.error("the rollout producer failed:\n%s", traceback.format_exc())
        key = err.key if isinstance(err, ConfigError) else None
        out.put(ProducerError(f"the rollout producer failed: {err}" if key is None else err.message, key))
    finally:
        if agent is not None:
            agent.close()
        if engine is not None:
            engine.close()


def _own_gpu(device: torch.device, engine: str) -> torch.device:
    """The producer's GPU (the trainer's ``device``), made the only one this process sees: before
    CUDA starts here, ``CUDA_VISIBLE_DEVICES`` is narrowed to it, so that it is ``cuda:0`` for the
    producer and for a vLLM engine built in it (which takes the first visible GPU). Nothing CUDA
    reaches the producer before this (its copy of the policy comes in CPU memory)."""
    index = device.index or 0
    if torch.cuda.is_initialized():  # not expected; the numbering is the trainer's then
        if engine != "hf" and index != 0:
            raise RuntimeError(
                f"CUDA started in the rollout producer before it could be given only {device}: a vLLM engine "
                "would take cuda:0"
            )
        torch.cuda.set_device(device)
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(index + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _next_ticket(jobs: Any, held: collections.deque) -> Ticket | None:
    """The next ticket to sample (None: the end): the first of those :func:`_admitted` held back,
    unless the trainer has closed the queue meanwhile (it takes back the tickets not started), or
    the queue's next."""
    if not held:
        return jobs.get()
    with contextlib.suppress(queue.Empty):
        held.append(jobs.get_nowait())
    return None if held[-1] is None else held.popleft()


def _admitted(
    jobs: Any, held: collections.deque, first: Ticket, version: int, room: int, longest: int | None
) -> list[Ticket]:
    """The tickets after ``first`` that are sampled in its batch (``algo.rollout.merge_rollouts``):
    at most ``room`` of those already handed out, in order, while each one's bound admits
    ``version``, its prompts merge with ``first``'s (rollout/merge.py ``mergeable``), and the
    batch's longest prompt stays within ``longest`` tokens (``merged_prompt_limit``; None: any).
    The first that does not stays in ``held``, sampled next."""
    group: list[Ticket] = []
    while len(group) < room:
        if not held:
            try:
                held.append(jobs.get_nowait())
            except queue.Empty:
                break
        nxt = held[0]
        if nxt is None or nxt.need > version or first.rng is not None or nxt.rng is not None:
            break  # not admitted yet, or bound 0 (sampled with the trainer's random state)
        if not mergeable(first.batch, nxt.batch):
            break
        if longest is not None and max(prompt_tokens(t.batch) for t in (first, *group, nxt)) > longest:
            break
        group.append(held.popleft())
    return group


def _recent(mean: float, seconds: float) -> float:
    """A recent mean (an exponential mean over the last few values, weight ½) of a side's idle
    seconds per rollout (the producer's wait for a ticket or for weights, the trainer's wait for a
    sample) or of the producer's scoring seconds per row: what ``reference_scoring=balanced``
    steers by (:class:`ReferenceShare`)."""
    return 0.5 * mean + 0.5 * seconds


@dataclass
class ReferenceShare:
    """Which rows of each sample the producer scores with the frozen reference (the first
    :meth:`rows`; the trainer scores the rest, rollout/collect.py ``generate_and_score``).
    ``reference_scoring=producer``: every row. ``balanced``: a share that starts at half and moves
    toward the split where both sides are equally busy (docs/async.md §1). A side that idles ``d``
    seconds more per rollout than the other has ``d`` seconds of the other's work to spare, and half
    of it evens them out: the share moves by ``(idle − trainer_wait) / 2`` seconds of scoring, at the
    producer's measured seconds per row, damped by half again against the noise of the recent means
    (:func:`_recent`) it steers by."""

    balanced: bool
    share: float = 0.5
    row_s: float = 0.0  # the producer's recent seconds of reference scoring per row; 0: not measured yet

    def rows(self, n: int) -> int:
        """How many of a sample's ``n`` rows the producer scores."""
        return round(self.share * n) if self.balanced else n

    def learn(self, idle: float, trainer_wait: float, n: int, scored: int, scored_s: float) -> None:
        """After a sample of ``n`` rows whose first ``scored`` the producer scored in ``scored_s``
        seconds: its recent idle seconds per rollout and the trainer's (:func:`_recent`) move the share."""
        if not self.balanced:
            return
        if scored:
            per_row = scored_s / scored
            self.row_s = per_row if not self.row_s else _recent(self.row_s, per_row)
        if self.row_s:
            step = (idle - trainer_wait) / 2 / (self.row_s * n) / 2
            self.share = min(1.0, max(0.0, self.share + step))


def _sample(
    model: nn.Module,
    tokenizer: Any,
    group: list[Ticket],
    settings: ProducerSettings,
    engine: Any,
    agent: Any,
    device: torch.device,
) -> tuple:
    """``sample_responses``' output for the tickets of ``group`` as one batch (``merged_batch``;
    one ticket: its own), with the trainer's random state (bound 0) or the first ticket's own seed."""
    first = group[0]
    if first.rng is not None:
        restore_rng(first.rng)
    else:
        torch.manual_seed(settings.seed * 1_000_003 + first.ticket)
    batch = first.batch if len(group) == 1 else merged_batch([j.batch for j in group], tokenizer.pad_token_id)
    with torch.inference_mode():
        return sample_responses(
            model,
            moved(batch, device),
            tokenizer,
            settings.gen,
            engine,
            settings.responses_per_prompt,
            settings.logprob_temperature,
            agent,
        )


def _reference_rows(
    drawn: tuple, settings: ProducerSettings, share: ReferenceShare, idle: float, trainer_wait: float
) -> tuple[torch.Tensor | None, float]:
    """(the frozen reference's log-probs of the first :meth:`ReferenceShare.rows` rows of a sample,
    None: none; the share of its rows they are), the share then moved by the two sides' recent
    waits (:meth:`ReferenceShare.learn`). The same computation as the trainer's (rollout/collect.py
    ``scored_logprobs``, same inputs, each row on its own), so it does not matter which side scores
    a row (bit for bit where both have as many threads)."""
    if settings.reference is None:
        return None, 0.0
    ids, mask, width = rollout_inputs(drawn)
    n = ids.shape[0]
    rows, ref, started = share.rows(n), None, time.perf_counter()
    if rows:
        with torch.inference_mode():
            ref = scored_logprobs(
                settings.reference, (ids[:rows], mask[:rows], width), settings.score_temperature, settings.padding_free
            )
    share.learn(idle, trainer_wait, n, rows, time.perf_counter() - started)
    return ref, rows / n


def _context() -> Any:
    """Processes forked from a fork server that has imported torch, transformers and the rollout
    path once (a producer, or a restarted one, starts in a fraction of a second instead of
    importing them again); a fresh interpreter each (spawn) where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class AsyncRollouts:
    """The trainer's side: start the producer, hand it tickets, take their rollouts in order,
    publish the weights after each iteration; restart a producer that died."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        settings: ProducerSettings,
        max_staleness: int,
        restarts: int,
        timeout_s: float,
        whole: bool = True,
        gathered: Callable[[], Any] = contextlib.nullcontext,
        sharing: int = 1,
    ) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.max_staleness, self.restarts, self.timeout_s = max_staleness, restarts, timeout_s
        # where the policy's weights are shards (ZeRO-3, FSDP): not whole, read inside gathered()
        self.whole, self.gathered = whole, gathered
        self.sharing = sharing  # the producers this host starts at once (its ranks): they share its /dev/shm
        self.ctx = _context()
        self.board: WeightBoard | None = None
        self.process: Any = None
        self.lifeline: Any = None  # the write end of the producer's lifeline (_watch_trainer)
        self.jobs: Any = None
        self.out: Any = None
        self.pending: dict[int, Ticket] = {}  # handed out, not yet taken
        self.ready: dict[int, Drawn] = {}  # delivered, not yet taken
        self.version = -1
        self.waited = 0.0  # the trainer's recent wait per rollout (shared with the producer: _recent)
        self.trainer_wait: Any = None
        self.starting = False  # the producer's first rollout since it started is not yet taken
        self.restarted = 0
        self.delivered = 0
        self.max_held = 0  # most rollouts handed out and not taken at once (the bound's check)

    # ------------------------------------------------------------------ the producer
    def start(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Start the producer with the policy's weights as ``version`` (the RL iterations done):
        ``tensors`` (:func:`trained_tensors`), else, at the first start, the policy's, gathered
        here (under ZeRO-3/FSDP a collective: every rank starts its producer at the same
        iteration), else (a restart) the last ones published."""
        if tensors is None and self.board is None:
            with self.gathered():
                return self.start(version, trained_tensors(self.model, self.whole))
        first = self.board is None
        tensors = self.board.tensors if tensors is None else tensors
        need = _nbytes(tensors.values())  # the board
        if self.whole:  # the copy holds what the board does not (policy_replica)
            trained = {id(p) for n, p in self.model.named_parameters() if n in tensors}
            need += _nbytes([p for p in self.model.parameters() if id(p) not in trained])
        need += _nbytes(self.model.buffers())  # a plain model's buffers: about the policy's
        reference = self.settings.reference  # a module, or the policy with its adapters off (its .model)
        if reference is not None:  # moved into shared memory the first time it goes to a producer
            held = reference if isinstance(reference, nn.Module) else reference.model
            need += _nbytes(t for t in [*held.parameters(), *held.buffers()] if not t.is_shared())
        # at the first start every rank of the host starts one; a restart is this rank's alone
        check_shared_memory(need, self.sharing if first else 1)
        # a board of its own: a producer killed while reading may have left the last one's lock taken
        self.board = WeightBoard(tensors, version, self.ctx)
        self.version = version
        self.jobs, self.out = self.ctx.Queue(), self.ctx.Queue()
        self.trainer_wait = self.ctx.Value("d", self.waited, lock=False)
        self.starting = True
        replica = policy_replica(self.model, self.board.tensors, self.whole)
        self._cut_lifeline()
        lifeline, self.lifeline = self.ctx.Pipe(duplex=False)  # the producer's end, and the one kept here
        args = (replica, self.tokenizer, self.settings, self.board, self.jobs, self.out, lifeline)
        args += (self.trainer_wait, os.getpid())  # the trainer, watched (_watch_trainer)
        self.process = self.ctx.Process(target=_produce, args=args, name="lit_rlhf-rollout-producer", daemon=True)
        self.process.start()
        lifeline.close()
        del replica
        for t in sorted(self.pending):  # a restart: the tickets not delivered, sampled again
            if t not in self.ready:
                self.jobs.put(self.pending[t])

    def publish(self, version: int) -> None:
        """The trained weights after RL iteration ``version`` − 1: the producer's from now on
        (gathered under ZeRO-3/FSDP: every rank publishes after every iteration)."""
        self.version = version
        if self.process is None:  # the next start publishes it
            return
        with self.gathered():
            tensors = trained_tensors(self.model, self.whole)
            if not self.board.publish(tensors, version, self.process.is_alive):
                # the producer died holding the board's lock: a new board holds these weights, from
                # which the next take() starts it again (or stops the run there, with a checkpoint)
                self.board = WeightBoard(tensors, version, self.ctx)

    def close(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        try:
            try:  # the tickets not yet started (those read ahead at the run's end) are not sampled
                while True:
                    self.jobs.get_nowait()
            except queue.Empty:
                pass
            self.jobs.put(None)
            process.join(timeout=10)
        finally:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
            for q in (self.jobs, self.out):
                q.cancel_join_thread()
                q.close()
            self._cut_lifeline()

    def _cut_lifeline(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    # ------------------------------------------------------------------ tickets
    def submit(self, ticket: int, batch: dict[str, Any], rng: dict[str, Any] | None = None) -> None:
        """Hand out ``ticket`` (the prompts of that RL iteration); ``rng``: the trainer's random state
        (bound 0 only)."""
        job = Ticket(ticket=ticket, batch=moved(batch, "cpu"), need=ticket - self.max_staleness, rng=rng)
        self.pending[ticket] = job
        self.max_held = max(self.max_held, len(self.pending))
        self.jobs.put(job)

    def handed_out(self, ticket: int) -> bool:
        return ticket in self.pending

    def hand_out(self, k: int, batches: list[dict[str, Any]], rng: Callable[[], dict[str, Any]] | None) -> None:
        """Hand out the tickets ``k, k+1, …`` of ``batches`` (RL iteration k's prompts and those the
        loader looked ahead at) that are not out yet; ``rng()``: the trainer's random state (bound 0)."""
        for j, batch in enumerate(batches):
            if not self.handed_out(k + j):
                self.submit(k + j, batch, rng() if rng is not None else None)

    def stats(self, k: int, drawn: Drawn, waited_s: float) -> dict[str, torch.Tensor]:
        """``async/*`` of iteration k's sample (docs/metrics.md): its staleness, one-hot over 0 … the
        bound (the histogram's share), the trainer's wait, the producer's timings, the rollouts
        sampled in its batch, the restarts."""
        staleness = k - drawn.version
        stats = {f"async/staleness_{v}": torch.tensor(float(v == staleness)) for v in range(self.max_staleness + 1)}
        stats.update(
            {
                "async/staleness": torch.tensor(float(staleness)),
                "async/wait_s": torch.tensor(waited_s),
                "async/producer_sample_s": torch.tensor(drawn.sample_s),
                "async/producer_weights_wait_s": torch.tensor(drawn.weights_wait_s),
                "async/producer_reference": torch.tensor(drawn.reference_share),
                "async/producer_merged": torch.tensor(float(drawn.merged)),
                "async/restarts": torch.tensor(float(self.restarted)),
            }
        )
        return stats

    def take(self, ticket: int) -> Drawn:
        """The rollout of ``ticket``, waiting for it; a dead producer is restarted (its tickets
        sampled again) up to ``restarts`` times in the run."""
        deadline = time.monotonic() + self.timeout_s
        asked = time.perf_counter()
        while ticket not in self.ready:
            try:
                item = self.out.get(timeout=POLL_S)
            except (OSError, EOFError):  # a rollout whose producer died before the trainer took its tensors
                self._lost_delivery()
                continue
            except queue.Empty:
                if not self.process.is_alive():
                    self._restart()
                elif time.monotonic() > deadline:
                    raise ProducerError(
                        f"the rollout producer has not delivered the rollout of RL iteration {ticket} in "
                        f"{self.timeout_s:.0f} s (algo.rollout.timeout_s)"
                    ) from None
                continue
            if isinstance(item, ProducerError) and item.key is not None:
                from lit_rlhf.utils.config import ConfigError

                raise ConfigError(item.key, str(item))
            if isinstance(item, ProducerError):
                raise item
            self.ready[item.ticket] = item
            self.delivered += 1
        self.pending.pop(ticket)
        if not self.starting:  # the wait for a first rollout is mostly the producer's start-up
            self.waited = self.trainer_wait.value = _recent(self.waited, time.perf_counter() - asked)
        self.starting = False
        return self.ready.pop(ticket)

    def _lost_delivery(self) -> None:
        """A delivered rollout could not be read: its tensors travel as file descriptors that the
        producer hands over when the trainer reads them, so a producer killed after it delivered
        takes them with it. Its tickets not yet read (this one among them) are sampled again by
        a restarted producer (one still alive, which cannot happen with a dead sender, is stopped
        first: the delivery is lost all the same)."""
        self.process.join(timeout=POLL_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        log.warning("a delivered rollout was lost with the rollout producer that sampled it")
        self._restart()

    def _restart(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Start a producer that died again with the weights of :attr:`version` (``tensors``, else
        the board's), unless it has died ``restarts`` times already."""
        code = self.process.exitcode
        if self.restarted >= self.restarts:
            hint = ""
            if not self.delivered and code == 1:
                hint = (
                    " It died before its first rollout: a script that starts training needs an "
                    "`if __name__ == '__main__':` guard (the producer process imports that script)."
                )
            raise ProducerError(
                f"the rollout producer died (exit code {code}) and was restarted {self.restarted} time(s) "
                f"already (algo.rollout.restarts={self.restarts}).{hint}"
            )
        self.restarted += 1
        log.warning(
            "the rollout producer died (exit code %s): starting it again (%d of algo.rollout.restarts=%d), "
            "its %d unfinished rollout(s) sampled again",
            code,
            self.restarted,
            self.restarts,
            len(self.pending) - len(self.ready),
        )
        self.process = None
        self.start(self.version, tensors)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


SHARED_MEMORY = "/dev/shm"


def check_shared_memory(need: int, sharing: int = 1) -> None:
    """Refuse to start a producer whose weights (the board, and what of the policy's copy on its way
    to the producer the board does not hold) would not fit the host's shared memory, where a
    process that writes past it dies of SIGBUS instead of an error (a container's /dev/shm is 64 MB
    unless it is given more):
    ``need`` bytes for each of the ``sharing`` producers this host starts at once. No check where
    there is no /dev/shm."""
    try:
        fs = os.statvfs(SHARED_MEMORY)
    except OSError:
        return
    free = fs.f_bavail * fs.f_frsize
    if need * sharing > free:
        from lit_rlhf.utils.config import ConfigError

        raise ConfigError(
            "algo.rollout.mode",
            f"async rollouts hand the producer the policy's weights through shared memory: {sharing} "
            f"producer(s) on this host need {_size(need * sharing)} of {SHARED_MEMORY}, which has "
            f"{_size(free)} free; give it more (a container: docker run --shm-size) or use "
            "algo.rollout.mode=sync",
        )


def split_threads(threads: int, bound: int, producer_threads: int | None) -> tuple[int, int]:
    """(the producer's torch threads, the trainer's) out of the trainer's ``threads``: half each by
    default (at least one). Bound 0 overlaps nothing: the producer gets them all and the trainer keeps
    its own (the float sums of a product depend on the thread count: the samples are then the
    synchronous run's bit for bit)."""
    if bound == 0:
        return producer_threads or threads, threads
    mine = producer_threads or max(1, threads // 2)
    return mine, max(1, threads - mine)
