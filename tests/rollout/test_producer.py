"""The asynchronous rollouts' producer (lit_rlhf/rollout/producer.py) on a real tiny Llama in a real
process: the staleness bound under heavy-tailed sampling times and a slow trainer, every
ticket delivered once and in order, each rollout sampled by the weights of the version it is stamped
with (greedy: compared with the trainer's own sample of those weights), bound 0's random state handed
over and back (the trainer's own sample, bit for bit), a killed producer restarted and its ticket
sampled again, the restarts' limit, and a producer whose trainer was SIGKILLed exits."""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lit_rlhf.data.prompts import collate_prompts
from lit_rlhf.models.builders import build_causal_lm
from lit_rlhf.rollout.collect import generate_and_score, rollout_inputs, sample_responses, scored_logprobs
from lit_rlhf.rollout.generate import GenerationConfig
from lit_rlhf.rollout.producer import (
    AsyncRollouts,
    ProducerError,
    ProducerSettings,
    ReferenceShare,
    WeightBoard,
    _context,
    trained_tensors,
)
from lit_rlhf.utils.config import ConfigError
from lit_rlhf.utils.rng import capture_rng, restore_rng
from tests.conftest import ROOT
from tests.helpers.producer_faults import (
    Logged,
    broken,
    first_slow,
    heavy_tailed,
    hold_the_lock,
    misconfigured,
    slow,
    wait_for_version,
)

pytestmark = pytest.mark.xdist_group("producer")
GREEDY = GenerationConfig(max_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def policy(tiny_spec, tokenizer):
    torch.manual_seed(0)
    return build_causal_lm(tiny_spec, tokenizer).eval()


def prompts(tokenizer, ticket: int) -> dict:
    rng = random.Random(ticket)
    words = ["the", "a", "one", "cat", "dog", "sat", "ran"]
    texts = [" ".join(rng.choice(words) for _ in range(3)) for _ in range(2)]
    return collate_prompts([(tokenizer(t)["input_ids"], t, {}) for t in texts], tokenizer.pad_token_id)


def producer(policy, tokenizer, bound: int, restarts: int = 1, **kw) -> AsyncRollouts:
    settings = ProducerSettings(gen=kw.pop("gen", GREEDY), responses_per_prompt=2, logprob_temperature=1.0, **kw)
    return AsyncRollouts(policy, tokenizer, settings, bound, restarts, timeout_s=120)


def nudge(model, k: int) -> None:
    """The trainer's "update" of iteration k: every weight moved (the greedy samples change)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.3)


@pytest.mark.parametrize("merge", [1, 3])
def test_staleness_stays_within_the_bound_and_every_ticket_is_trained(policy, tokenizer, merge, bound=2):
    """Every ticket delivered once, in order, within the bound, and equal to what the weights of its
    version sample for its prompts alone (greedy), also where it was sampled in one batch with the
    tickets after it (``merge``: the first ticket is slow, so the next ones wait together if they
    did not start with it)."""
    model = replace_model(policy)
    versions = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    rollouts = producer(model, tokenizer, bound, delay=first_slow if merge > 1 else heavy_tailed, merge_rollouts=merge)
    rollouts.start(0)
    n, handed, seen, merged = 10, 0, [], []
    slow_trainer = random.Random(1)
    try:
        for k in range(n):
            while handed <= min(k + bound, n - 1):  # the loader's lookahead: this ticket and `bound` more
                rollouts.submit(handed, prompts(tokenizer, handed))
                handed += 1
            assert len(rollouts.pending) <= bound + 1
            drawn = rollouts.take(k)
            assert drawn.ticket == k and k - bound <= drawn.version <= k, (k, drawn.version)
            seen.append(k - drawn.version)
            merged.append(drawn.merged)
            # the rollout is what the weights of its version sample
            twin = replace_model(policy, versions[drawn.version])
            batch, (ids, _, _, logps), _ = sample_responses(
                twin, prompts(tokenizer, k), tokenizer, GREEDY, None, 2, 1.0
            )
            assert torch.equal(drawn.drawn[1][0], ids) and torch.equal(
                drawn.drawn[0]["prompt_ids"], batch["prompt_ids"]
            )
            torch.testing.assert_close(drawn.drawn[1][3], logps)
            time.sleep(min(0.05 * slow_trainer.paretovariate(1.2), 1.0))  # a slow, uneven trainer
            nudge(model, k)
            versions[k + 1] = {name: v.clone() for name, v in model.state_dict().items()}
            rollouts.publish(k + 1)
    finally:
        rollouts.close()
    assert rollouts.max_held <= bound + 1 and not rollouts.pending and not rollouts.ready
    assert max(seen) <= bound and seen[0] == 0
    assert max(merged) <= merge and (max(merged) > 1 if merge > 1 else set(merged) == {1})


def replace_model(policy, state: dict | None = None):
    import copy

    twin = copy.deepcopy(policy)
    if state is not None:
        twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_bound_zero_samples_with_the_trainers_random_state(policy, tokenizer, autocast):
    """At bound 0 the producer's sample is the trainer's own, bit for bit, and the random state it
    hands back is the one the trainer's sampling would have left; the reference's log-probs, scored
    by the producer, are the trainer's own scoring of that sample. ``autocast``: the trainer samples
    under its training step's autocast (``bf16-mixed``), and so does the producer it names it to."""
    sampled = GenerationConfig(max_new_tokens=6, temperature=1.0)
    reference = replace_model(policy)  # scored where sampled: the reference's log-probs come with the sample
    threads = torch.get_num_threads()
    rollouts = producer(policy, tokenizer, 0, gen=sampled, threads=threads, reference=reference, autocast=autocast)
    rollouts.start(0)
    try:
        torch.manual_seed(7)
        state = capture_rng()
        rollouts.submit(0, prompts(tokenizer, 0), state)
        drawn = rollouts.take(0)
    finally:
        rollouts.close()
    restore_rng(state)
    trainers = torch.autocast("cpu", autocast, enabled=autocast is not None)
    with torch.inference_mode(), trainers:
        _, (ids, mask, ended, logps), _ = sample_responses(
            policy, prompts(tokenizer, 0), tokenizer, sampled, None, 2, 1.0
        )
    after = torch.get_rng_state()
    assert torch.equal(drawn.drawn[1][0], ids) and torch.equal(drawn.drawn[1][1], mask)
    assert torch.equal(drawn.drawn[1][3], logps)
    assert torch.equal(drawn.rng["torch"], after) and drawn.version == 0
    with torch.inference_mode(), trainers:
        ref = scored_logprobs(reference, rollout_inputs(drawn.drawn), 1.0, False)
    assert torch.equal(drawn.ref_logprobs, ref)
    if autocast is not None:  # not the full-precision numbers: the producer did sample under autocast
        with torch.inference_mode():
            assert not torch.equal(ref, scored_logprobs(reference, rollout_inputs(drawn.drawn), 1.0, False))


@pytest.mark.parametrize("slower", ["trainer", "producer"])
def test_balanced_reference_scoring_moves_the_rows_to_the_side_that_waits(policy, tokenizer, slower):
    """``reference_scoring=balanced``: the producer starts with half of each sample's rows; beside a
    slow trainer (the producer waits for tickets) it takes them all, beside a fast one (the trainer
    waits for samples) it leaves them all to the trainer. What it scores is the trainer's own
    scoring of those rows."""
    reference = replace_model(policy)
    rollouts = producer(
        policy,
        tokenizer,
        1,
        reference=reference,
        reference_scoring="balanced",
        threads=torch.get_num_threads(),
        delay=slow if slower == "producer" else None,
    )
    rollouts.start(0)
    drawn = []
    try:
        rollouts.submit(0, prompts(tokenizer, 0))
        for k in range(7):  # the trainer does nothing but wait (or sleep: slower) until the end
            rollouts.submit(k + 1, prompts(tokenizer, k + 1))
            drawn.append(rollouts.take(k))
            if slower == "trainer":
                time.sleep(0.5)
            rollouts.publish(k + 1)
    finally:
        rollouts.close()
    shares = [d.reference_share for d in drawn]
    assert shares[0] == 0.5, shares  # 2 prompts x 2 responses: the first 2 rows
    # the first tickets steer by the start-up's waits; from the fourth on, each side's recent wait
    assert all(x == (1.0 if slower == "trainer" else 0.0) for x in shares[3:]), shares
    for d in drawn:
        rows = round(d.reference_share * 4)
        assert (d.ref_logprobs is None) == (rows == 0)
        if rows:
            ids, mask, width = rollout_inputs(d.drawn)
            with torch.inference_mode():
                whole = scored_logprobs(reference, (ids, mask, width), 1.0, False)
            assert d.ref_logprobs.shape[0] == rows and torch.equal(d.ref_logprobs, whole[:rows])


def test_the_balanced_share_moves_by_half_the_idle_difference_in_rows():
    """Hand-computed: 16 rows, 0.01 s per row. The producer idled 0.2 s per rollout and the trainer
    waited nothing: the trainer is 0.2 s busier, so moving 0.1 s of scoring (10 rows) evens them
    out; damped by half, 5 rows: the share goes 0.5 -> 0.8125. The other way round it goes down,
    and it stays within [0, 1]."""
    share = ReferenceShare(balanced=True)
    assert share.rows(16) == 8
    share.learn(idle=0.2, trainer_wait=0.0, n=16, scored=8, scored_s=0.08)
    assert share.row_s == pytest.approx(0.01) and share.share == pytest.approx(0.8125)
    assert share.rows(16) == 13
    share.learn(idle=0.0, trainer_wait=0.2, n=16, scored=13, scored_s=0.13)  # the same rate: row_s stays
    assert share.row_s == pytest.approx(0.01) and share.share == pytest.approx(0.5)
    share.learn(idle=0.0, trainer_wait=5.0, n=16, scored=8, scored_s=0.24)  # 0.03 s per row now
    assert share.row_s == pytest.approx(0.02) and share.share == 0.0 and share.rows(16) == 0
    share.learn(idle=0.5, trainer_wait=0.0, n=16, scored=0, scored_s=0.0)  # nothing scored: rate kept
    assert share.row_s == pytest.approx(0.02) and share.share == pytest.approx(0.5 / 2 / 0.32 / 2)
    producer_side = ReferenceShare(balanced=False)
    producer_side.learn(idle=0.0, trainer_wait=9.0, n=16, scored=16, scored_s=0.1)
    assert producer_side.rows(16) == 16  # reference_scoring=producer: every row, whatever the waits


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_trainer_scores_the_rows_the_producer_left(policy, tokenizer, padding_free):
    """A sample whose first rows' reference log-probs come from the producer: the trainer scores the
    others, and the rollout holds the same log-probs as one whose rows were all scored at once."""
    reference = replace_model(policy)
    gen = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0)
    torch.manual_seed(3)
    with torch.inference_mode():
        drawn = sample_responses(policy, prompts(tokenizer, 5), tokenizer, gen, None, 3, 1.0)
        ids, mask, width = rollout_inputs(drawn)
        assert ids.shape[0] == 6

        def scored(first):
            return generate_and_score(
                policy,
                drawn[0],
                tokenizer,
                gen,
                reference=reference,
                policy_logprobs=False,
                padding_free=padding_free,
                drawn=drawn,
                ref_logprobs=first,
            ).ref_logprobs

        whole = scored(None)
        for rows in (1, 4, 6):
            first = scored_logprobs(reference, (ids[:rows], mask[:rows], width), 1.0, padding_free)
            assert torch.equal(scored(first), whole), rows
    assert not torch.equal(whole, torch.zeros_like(whole))


def test_a_killed_producer_is_started_again_and_then_stops_the_run(policy, tokenizer):
    rollouts = producer(policy, tokenizer, 0, restarts=1)
    rollouts.start(0)
    try:
        rollouts.submit(1, prompts(tokenizer, 1))  # waits for version 1: the producer is idle in the board
        time.sleep(1.0)
        os.kill(rollouts.process.pid, signal.SIGKILL)
        rollouts.process.join(10)
        rollouts.publish(1)
        drawn = rollouts.take(1)  # the restarted producer samples ticket 1 again
        assert drawn.ticket == 1 and drawn.version == 1 and rollouts.restarted == 1
        rollouts.submit(2, prompts(tokenizer, 2))
        os.kill(rollouts.process.pid, signal.SIGKILL)
        with pytest.raises(ProducerError, match=r"algo.rollout.restarts=1"):
            rollouts.take(2)
    finally:
        rollouts.close()


def test_a_reader_killed_while_it_waits_for_a_version_does_not_block_the_next_publish():
    """A producer killed while it waits on the board for a version (a ``multiprocessing.Condition``
    sleeper killed mid-wait made the next ``notify`` wait for it forever): the trainer's next publish
    goes through, and the next reader gets that version."""
    ctx = _context()
    board = WeightBoard({"weight": torch.zeros(1, 3)}, 0, ctx)
    ready = ctx.Event()
    reader = ctx.Process(target=wait_for_version, args=(board, 1, ready), daemon=True)
    reader.start()
    assert ready.wait(60)
    time.sleep(0.3)  # inside read(), waiting for version 1
    reader.kill()
    reader.join(10)
    published = []
    writer = threading.Thread(target=lambda: published.append(board.publish({"weight": torch.ones(1, 3)}, 1, bool)))
    writer.start()
    writer.join(30)
    assert published == [True]
    linear = torch.nn.Linear(3, 1, bias=False)
    assert board.read(linear, 1, 0) == (1, 2) and torch.equal(linear.weight.detach(), torch.ones(1, 3))


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_producer_that_died_holding_the_board_gets_the_weights_at_the_next_take(policy, tokenizer, restarts):
    """The producer died holding the board's lock, so the trainer's publish of version 1 cannot write
    it: publish() returns (the update is done; raising there would skip the stop with a checkpoint),
    and the next take() restarts the producer with version 1's weights, which sample its ticket; with
    no restarts left, take() raises, inside the trainer's stop-with-a-checkpoint path."""
    model = replace_model(policy)
    rollouts = producer(model, tokenizer, 1, restarts=restarts)
    rollouts.start(0)
    holder = None
    try:
        ready = rollouts.ctx.Event()
        holder = rollouts.ctx.Process(target=hold_the_lock, args=(rollouts.board, ready), daemon=True)
        holder.start()
        assert ready.wait(60)
        holder.kill()  # the lock stays taken
        holder.join(10)
        os.kill(rollouts.process.pid, signal.SIGKILL)
        rollouts.process.join(10)
        nudge(model, 1)
        rollouts.publish(1)  # returns: the weights wait for the restart
        rollouts.submit(2, prompts(tokenizer, 2))  # ticket 2 needs version 1
        if restarts == 0:
            with pytest.raises(ProducerError, match=r"algo.rollout.restarts=0"):
                rollouts.take(2)
            return
        drawn = rollouts.take(2)
        assert drawn.version == 1 and rollouts.restarted == 1
        weights = trained_tensors(model, True)
        assert all(torch.equal(rollouts.board.tensors[n], weights[n]) for n in weights)
        again = sample_responses(model, prompts(tokenizer, 2), tokenizer, GREEDY, None, 2, 1.0)
        assert torch.equal(drawn.drawn[1][0], again[1][0])
    finally:
        rollouts.close()


def test_closing_skips_the_tickets_not_started(policy, tokenizer, tmp_path):
    """At the end of a fit the tickets read ahead are not sampled: close() takes them back before it
    stops the producer, which finishes the ticket it is on."""
    log = tmp_path / "started"
    rollouts = producer(policy, tokenizer, 3, delay=Logged(str(log), 0.5))
    rollouts.start(0)
    try:
        for k in range(4):
            rollouts.submit(k, prompts(tokenizer, k))
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rollouts.close()
    assert log.read_text().split() == ["0"]


def test_a_rollout_delivered_by_a_producer_killed_before_it_was_taken_is_sampled_again(policy, tokenizer):
    """The producer delivered ticket 0 and was SIGKILLed before the trainer took it: the rollout's
    tensors (file descriptors the sender hands over on reading) are gone with it; the trainer restarts
    the producer, which samples ticket 0 again, the same greedy responses."""
    rollouts = producer(policy, tokenizer, 1, restarts=1)
    rollouts.start(0)
    try:
        rollouts.submit(0, prompts(tokenizer, 0))
        deadline = time.monotonic() + 120
        while rollouts.out.empty() and time.monotonic() < deadline:  # delivered, not taken
            time.sleep(0.05)
        assert not rollouts.out.empty()
        os.kill(rollouts.process.pid, signal.SIGKILL)
        rollouts.process.join(10)
        drawn = rollouts.take(0)
        assert drawn.ticket == 0 and drawn.version == 0 and rollouts.restarted == 1
        again = sample_responses(policy, prompts(tokenizer, 0), tokenizer, GREEDY, None, 2, 1.0)
        assert torch.equal(drawn.drawn[1][0], again[1][0])
    finally:
        rollouts.close()


@pytest.mark.parametrize(
    "fault, error, message",
    [
        (broken, ProducerError, "the rollout producer failed: ticket 0: the environment is broken"),
        (misconfigured, ConfigError, "^algo.generation.engine: no kernel for this head size$"),
    ],
)
def test_the_producers_exception_stops_the_trainer_with_its_message(policy, tokenizer, fault, error, message):
    """Any exception with the producer's message; a configuration error as itself, naming its key."""
    rollouts = producer(policy, tokenizer, 1, delay=fault)
    rollouts.start(0)
    try:
        rollouts.submit(0, prompts(tokenizer, 0))
        with pytest.raises(error, match=message):
            rollouts.take(0)
    finally:
        rollouts.close()


@pytest.mark.parametrize("forked", [False, True])
def test_a_producer_whose_trainer_was_killed_exits(policy, tokenizer, tmp_path, forked):
    """The trainer SIGKILLed while the producer samples a (minute-long) ticket: the producer is gone
    within seconds, not left behind holding memory; also when a process the trainer forked after
    starting it (as a DataLoader worker is) lives on, holding a copy of the lifeline's write end."""
    script, marker = tmp_path / "trainer.py", tmp_path / "sampling"
    script.write_text(
        "import sys, time, torch\n"
        "from tests.rollout.test_producer import prompts, producer\n"
        "from tests.helpers.producer_faults import Stuck\n"
        "from lit_rlhf.data.tokenizers import build_tokenizer\n"
        "from lit_rlhf.models.builders import build_causal_lm\n"
        "from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig\n"
        "if __name__ == '__main__':  # the producer imports this file again\n"
        "    spec = ModelSpec(tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,"
        " intermediate_size=64), tokenizer='synthetic')\n"
        "    tok = build_tokenizer(spec)\n"
        f"    r = producer(build_causal_lm(spec, tok), tok, 1, delay=Stuck({str(marker)!r}))\n"
        "    r.start(0)\n"
        "    r.submit(0, prompts(tok, 0))\n"
        "    print(r.process.pid, flush=True)\n"
        + (
            "    import os\n"
            "    forked = os.fork()\n"
            "    if forked == 0:  # a child that outlives the trainer\n"
            "        time.sleep(90)\n"
            "        os._exit(0)\n"
            "    print(forked, flush=True)\n"
            if forked
            else ""
        )
        + "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    orphan = None
    try:
        child = int(trainer.stdout.readline())
        orphan = int(trainer.stdout.readline()) if forked else None
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:  # the producer is in its ticket
            time.sleep(0.1)
        assert marker.exists() and running(child)
        trainer.kill()
        trainer.wait(30)
        deadline = time.monotonic() + 20  # it is in its minute-long ticket: it must not finish it first
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(child), "the producer outlived its trainer"
        assert orphan is None or running(orphan)  # the copy of the lifeline's write end still open
    finally:
        trainer.kill()
        if orphan is not None and running(orphan):
            os.kill(orphan, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "\nState:\tZ" not in fh.read()
    except FileNotFoundError:
        return False


def test_the_copy_of_a_sharded_policy_is_a_plain_model_that_takes_every_weight(policy):
    """Under ZeRO-3/FSDP the producer's copy is a model of the policy's config that the board's
    weights (all of them, :func:`trained_tensors` inside the gathered context; a tied head once)
    overwrite: it then computes the policy's logits; building it draws nothing from the trainer's
    random state; a weight the copy has no place for is refused, naming the key."""
    from lit_rlhf.rollout.producer import WeightBoard, own_weights, policy_replica, trained_tensors

    assert trained_tensors(policy, whole=True).keys() == {n for n, p in policy.named_parameters() if p.requires_grad}
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # the tiny Llama ties its head
    weights = trained_tensors(policy, whole=False)
    assert weights.keys() == {n for n, _ in policy.named_parameters()} and "lm_head.weight" not in weights
    weights = {n: t * 0.5 for n, t in weights.items()}  # the trainer's newer weights
    state = capture_rng()
    replica = policy_replica(policy, weights, whole=False)
    assert torch.equal(capture_rng()["torch"], state["torch"])
    assert type(replica) is type(policy) and not replica.training
    assert replica.lm_head.weight is replica.model.embed_tokens.weight
    # hollow on its way to the producer: the board holds every weight, the producer allocates them
    assert all(p.numel() == 0 for p in replica.parameters())
    board = WeightBoard(weights, 0, torch.multiprocessing.get_context("spawn"))
    own_weights(replica, board.tensors)
    assert board.read(replica, 0, 0) == (0, 1)
    ids, halved = torch.tensor([[3, 4, 5, 6]]), copy.deepcopy(policy)
    with torch.no_grad():
        for p in halved.parameters():
            p.mul_(0.5)
        torch.testing.assert_close(replica(ids).logits, halved(ids).logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"rollout\.mode.*model\.extra\.weight"):
        policy_replica(policy, {**weights, "model.extra.weight": torch.zeros(1)}, whole=False)


def test_the_whole_copy_of_a_lora_policy_carries_its_frozen_base_and_leaves_the_adapters_to_the_board(
    tiny_spec, tokenizer
):
    """Where ranks hold whole weights the producer's copy is a deep copy that goes to it hollow:
    the board's weights (a LoRA policy's adapters, its trainable tensors) are empty placeholders the
    producer allocates (:func:`own_weights`), the frozen base is copied (its own memory, not the
    trainer's); after the board's first read the copy computes the policy's logits."""
    from lit_rlhf.rollout.producer import WeightBoard, own_weights, policy_replica, trained_tensors
    from tests.models.test_lora import _adapted

    _, model = _adapted(tiny_spec, tokenizer)
    model.eval()
    weights = trained_tensors(model, whole=True)
    assert weights and all(".lora_" in n for n in weights)
    replica = policy_replica(model, weights, whole=True)
    mine, theirs = dict(replica.named_parameters()), dict(model.named_parameters())
    assert all(mine[n].numel() == 0 for n in weights)
    frozen = [n for n in theirs if n not in weights]
    assert frozen and all(torch.equal(mine[n], theirs[n]) for n in frozen)
    assert not any(mine[n].data_ptr() == theirs[n].data_ptr() for n in frozen)
    board = WeightBoard(weights, 0, torch.multiprocessing.get_context("spawn"))
    own_weights(replica, board.tensors)
    assert board.read(replica, 0, 0) == (0, 1)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(replica(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_producer_is_not_started_where_shared_memory_cannot_hold_its_weights(policy, tokenizer, monkeypatch):
    """The board (the trained tensors) and the policy's copy on its way to the producer go through
    /dev/shm: a start that needs more than it has free is refused with the key and the sizes, each of
    the host's producers counted, before anything is written there."""
    import lit_rlhf.rollout.producer as producer_module

    weights = sum(p.numel() * 4 for p in policy.parameters())  # fp32, every parameter trainable
    # the board, and the copy's buffers: its parameters are all on the board (policy_replica)
    need = weights + sum(b.numel() * b.element_size() for b in policy.buffers())
    real, free = os.statvfs, {"bytes": 0}

    def statvfs(path):
        if path != "/dev/shm":
            return real(path)
        return type("Fs", (), {"f_bavail": free["bytes"] // 8, "f_frsize": 8})()

    monkeypatch.setattr(producer_module.os, "statvfs", statvfs)
    free["bytes"] = 2 * need - 8  # two producers on this host: 8 bytes short
    rollouts = AsyncRollouts(policy, tokenizer, producer(policy, tokenizer, 1).settings, 1, 0, 120, sharing=2)
    with pytest.raises(
        ConfigError, match=r"algo.rollout.mode: .*2 producer\(s\) on this host need [0-9.]+ MiB of /dev/shm"
    ):
        rollouts.start(0)
    assert rollouts.process is None and rollouts.board is None
    free["bytes"] = 2 * need  # room for both: it starts
    try:
        rollouts.start(0)
        assert rollouts.process.is_alive()
    finally:
        rollouts.close()


def test_a_lora_policys_reference_with_its_adapters_off_is_scored_by_the_producer(tiny_spec, tokenizer):
    """A LoRA policy's frozen reference is the policy itself with its adapters off
    (lit_rlhf/models/lora.py ``AdaptersDisabled``): it goes to the producer (pickled, its memory
    shared) and scores there what the base model without adapters scores."""
    from lit_rlhf.models.lora import AdaptersDisabled
    from tests.models.test_lora import _adapted

    base, model = _adapted(tiny_spec, tokenizer)
    model.eval()
    rollouts = producer(model, tokenizer, 1, reference=AdaptersDisabled(model), reference_scoring="producer")
    rollouts.start(0)
    try:
        rollouts.submit(0, prompts(tokenizer, 0))
        drawn = rollouts.take(0)
    finally:
        rollouts.close()
    with torch.inference_mode():
        expected = scored_logprobs(base, rollout_inputs(drawn.drawn), 1.0, False)
        adapted = scored_logprobs(model, rollout_inputs(drawn.drawn), 1.0, False)
    torch.testing.assert_close(drawn.ref_logprobs, expected)
    assert not torch.allclose(drawn.ref_logprobs, adapted, atol=1e-3)  # the adapters were off


def test_a_producer_on_a_gpu_sees_only_its_ranks_gpu(monkeypatch):
    """On a GPU the producer narrows CUDA_VISIBLE_DEVICES to its rank's device before CUDA starts in
    it (then cuda:0 for it and for a vLLM engine built in it, which takes the first visible GPU),
    counting in the trainer's numbering (the variable's list, or every GPU where it is unset). Where
    CUDA had started already it keeps that numbering, and refuses a vLLM engine off cuda:0."""
    from lit_rlhf.rollout.producer import _own_gpu

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, GPU-7f3a")
    assert _own_gpu(torch.device("cuda", 1), "vllm") == torch.device("cuda", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-7f3a" and chosen == [0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _own_gpu(torch.device("cuda", 3), "hf") == torch.device("cuda", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _own_gpu(torch.device("cuda", 1), "hf") == torch.device("cuda", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and chosen[-1] == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="a vLLM engine would take cuda:0"):
        _own_gpu(torch.device("cuda", 1), "vllm")


def test_what_crosses_is_moved_whole_and_a_tensor_held_twice_once():
    """``moved`` (each side's move of a ticket or a rollout to its device) reaches every tensor in the
    dicts, lists, named tuples and dataclasses the rollout path returns, leaves the rest as it is,
    and moves a tensor held in two places once (a multi-turn rollout holds its ids in both)."""
    from collections import namedtuple

    from lit_rlhf.rollout.agent import AgentRollout
    from lit_rlhf.rollout.producer import moved

    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)
    turns = AgentRollout(ids, mask, ids, mask, mask, torch.ones(2), None, ["a", "b"], [0.5, 1.0], [1, 0], [2, 1])
    Pair = namedtuple("Pair", "left right")
    drawn = ({"prompt_ids": ids, "texts": ["x"], "n": 3}, (ids, mask, Pair(mask, None)), turns)
    batch, sampled, out = moved(drawn, "meta")
    assert batch["prompt_ids"].is_meta and batch["texts"] == ["x"] and batch["n"] == 3
    assert all(t.is_meta for t in (*sampled[:2], sampled[2].left)) and sampled[2].right is None
    assert isinstance(sampled[2], Pair) and isinstance(out, AgentRollout) and out.texts == ["a", "b"]
    assert out.response_ids.is_meta and out.sampler_logprobs is None and out.env_reward == [0.5, 1.0]
    assert batch["prompt_ids"] is sampled[0] is out.prompt_ids is out.response_ids  # one tensor, moved once
    assert ids.device.type == "cpu" and not ids.is_meta  # the original stays where it was


def test_a_merged_sample_is_cut_into_each_tickets_rows_at_its_own_widths():
    """``split_sample`` of a two-ticket batch (hand-made: ticket A's prompts 2 tokens wide, B's 3; A's
    responses 2 tokens long, B's 4): each part holds its rows with only its own padding, as sampling
    it alone pads them; a multi-turn sample's counts go with their rows."""
    from lit_rlhf.rollout.agent import AgentRollout
    from lit_rlhf.rollout.merge import merged_batch, split_sample

    a = {
        "prompt_ids": torch.tensor([[5, 6], [0, 7]]),
        "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
        "prompts": ["a", "b"],
    }
    b = {"prompt_ids": torch.tensor([[8, 9, 10]]), "prompt_mask": torch.tensor([[1, 1, 1]]), "prompts": ["c"]}
    for batch in (a, b):
        batch["columns"] = {"answer": [p.upper() for p in batch["prompts"]]}
    batch = merged_batch([a, b], pad_id=0)
    assert batch["prompt_ids"].tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 10]]
    assert batch["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert batch["prompts"] == ["a", "b", "c"] and batch["columns"] == {"answer": ["A", "B", "C"]}
    ids = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 7]])
    mask = (ids > 0).long()
    logps = -ids.float()
    ended = torch.tensor([True, True, False])
    (pa, sa, ta), (pb, sb, tb) = split_sample((batch, (ids, mask, ended, logps), None), [2, 1])
    assert (
        pa["prompt_ids"].tolist() == a["prompt_ids"].tolist()
        and pa["prompt_mask"].tolist() == a["prompt_mask"].tolist()
    )
    assert pb["prompt_ids"].tolist() == b["prompt_ids"].tolist() and pa["columns"] == {"answer": ["A", "B"]}
    assert sa[0].tolist() == [[1, 2], [3, 0]] and sa[1].tolist() == [[1, 1], [1, 0]] and sa[2].tolist() == [True, True]
    assert sa[3].tolist() == [[-1.0, -2.0], [-3.0, 0.0]] and ta is None and tb is None
    assert sb[0].tolist() == [[4, 5, 6, 7]] and sb[2].tolist() == [False] and pb["prompts"] == ["c"]
    # multi-turn: the environment's tokens (attended, not the policy's) count toward a part's width
    attention = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    counts = [{"turns": 2, "tool_calls": 1}, {"turns": 1, "tool_calls": 0}, {"turns": 3, "tool_calls": 2}]
    turns = AgentRollout(
        batch["prompt_ids"],
        batch["prompt_mask"],
        ids,
        mask,
        attention,
        ended,
        None,
        ["x", "y", "z"],
        [0.5, 1.0, 0.0],
        [1, 0, 2],
        [2, 1, 3],
        counts,
    )
    agent_batch = {**batch, "prompt_ids": turns.prompt_ids, "prompt_mask": turns.prompt_mask}
    sampled = (ids, mask, ended, None)
    (pa, sa, ta), (pb, sb, tb) = split_sample((agent_batch, sampled, turns), [2, 1])
    assert ta.response_ids.tolist() == [[1, 2, 0], [3, 0, 0]] and ta.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (
        sa[0] is ta.response_ids
        and pa["prompt_ids"] is ta.prompt_ids
        and ta.prompt_ids.tolist() == a["prompt_ids"].tolist()
    )
    assert ta.texts == ["x", "y"] and ta.counts == counts[:2] and tb.counts == counts[2:] and tb.tool_calls == [2]
    assert ta.sampler_logprobs is None and tb.response_ids.shape == (1, 4)


def test_tickets_sampled_as_one_batch_are_those_each_samples_alone(policy, tokenizer):
    """The hf loop, greedy, over two tickets' prompts merged (different prompt widths): each ticket's
    part equals its own sample, tokens, padding and the sampler's log-probs."""
    from lit_rlhf.rollout.merge import merged_batch, split_sample

    tickets = [
        prompts(tokenizer, 3),
        collate_prompts(
            [(tokenizer(t)["input_ids"], t, {}) for t in ["the cat sat on a mat", "a"]], tokenizer.pad_token_id
        ),
    ]
    assert tickets[0]["prompt_ids"].shape[1] != tickets[1]["prompt_ids"].shape[1]
    merged = sample_responses(policy, merged_batch(tickets, tokenizer.pad_token_id), tokenizer, GREEDY, None, 2, 1.0)
    for ticket, part in zip(tickets, split_sample(merged, [4, 4])):
        alone = sample_responses(policy, ticket, tokenizer, GREEDY, None, 2, 1.0)
        assert torch.equal(part[0]["prompt_ids"], alone[0]["prompt_ids"]) and part[0]["prompts"] == alone[0]["prompts"]
        for mine, theirs in zip(part[1][:3], alone[1][:3]):
            assert torch.equal(mine, theirs)
        torch.testing.assert_close(part[1][3], alone[1][3])


def test_admission_takes_the_queued_tickets_the_bound_and_the_positions_admit():
    """``_admitted`` adds the queued tickets after the first while their bound admits the version read
    and the batch's longest prompt stays within the limit; the first that does not stays held and is
    sampled next; the end marker stops it and ends the producer."""
    import collections
    import queue
    from types import SimpleNamespace

    from lit_rlhf.rollout.merge import merged_prompt_limit
    from lit_rlhf.rollout.producer import Ticket, _admitted, _next_ticket

    def ticket(k: int, need: int, tokens: int) -> Ticket:
        mask = torch.zeros(2, 6, dtype=torch.long)
        mask[0, 6 - tokens :] = 1
        mask[1, -1] = 1
        return Ticket(
            ticket=k, batch={"prompt_ids": mask.clone(), "prompt_mask": mask, "prompts": ["a", "b"]}, need=need
        )

    jobs, held = queue.Queue(), collections.deque()
    for t in (ticket(1, -1, 2), ticket(2, 0, 5), ticket(3, 1, 2), None):
        jobs.put(t)
    first = ticket(0, -2, 3)
    assert [t.ticket for t in _admitted(jobs, held, first, 0, 3, longest=4)] == [1]  # ticket 2's 5 tokens: over 4
    assert [t.ticket for t in held] == [2]
    second = _next_ticket(jobs, held)  # the held ticket first (ticket 3 comes off the queue behind it)
    assert second.ticket == 2 and [t.ticket for t in held] == [3]
    assert _admitted(jobs, held, second, 0, 3, longest=None) == []  # ticket 3 needs version 1
    assert [t.ticket for t in _admitted(jobs, held, second, 1, 3, longest=None)] == [3] and list(held) == [None]
    assert _next_ticket(jobs, held) is None
    # the limit: the model's positions less max_new_tokens with the hf loop; none with vLLM or no positions
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    hf = GenerationConfig(max_new_tokens=24)
    assert merged_prompt_limit(model, hf, None) == 40
    assert merged_prompt_limit(SimpleNamespace(config=SimpleNamespace()), hf, None) is None
    assert merged_prompt_limit(model, GenerationConfig(engine="vllm", max_new_tokens=24), None) is None
    # multi-turn: prompts are rendered with their tools, bounded by max_prompt_length only
    for rendered, limit in ((40, None), (41, -1), (None, -1)):
        assert merged_prompt_limit(model, hf, SimpleNamespace(max_prompt_length=rendered)) == limit
