"""CriticFreeModule on tiny models: groups, the KL switch, dynamic sampling, reward callables, errors."""

import math

import lightning.pytorch as pl
import pytest
import torch

from lit_rlhf.data.prompts import PromptDataModule
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.modules.configs import CriticFreeConfig
from lit_rlhf.modules.critic_free import CriticFreeModule
from lit_rlhf.rollout.scorers import RewardFunctionError
from lit_rlhf.utils.config import ConfigError, build_config
from tests.helpers.presets import preset

GOLD = {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}


def make(saved_models, tokenizer, algo="grpo", **kw):
    """The ``algo`` preset (lit_rlhf/conf/algo/<algo>.yaml) on the tiny saved models: a larger lr, a short
    rollout (groups of 4 where the preset has groups) and 6 new tokens, then ``kw``."""
    base = preset(algo)
    args = dict(
        policy_path=saved_models[0],
        reward_path=saved_models[1],
        lr=1e-3,
        rollout_batch_size=16,
        generation={"max_new_tokens": 6},
        **({"num_generations": 4} if base["num_generations"] > 1 else {}),
    )
    args.update(kw)
    if any(k in kw for k in ("reward_fn", "reward_fns")):
        args["reward_path"] = None
    cfg = build_config(CriticFreeConfig, preset(algo, args), "algo")
    spec = CriticFreeModule.resolve_model_spec(cfg, ModelSpec(name_or_path="the model group, unused"))
    return CriticFreeModule(cfg, model=spec, tokenizer=tokenizer)


def data(tokenizer, prompts=4):
    return PromptDataModule(n_train=64, n_val=8, batch_size=prompts).connect(tokenizer)


def fit(module, dm, max_steps, **kw):
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **{"limit_val_batches": 0, **kw},
    )
    trainer.fit(module, dm)
    return trainer


class Keep(pl.Callback):
    def __init__(self):
        self.outputs = []

    def on_train_batch_end(self, trainer, module, out, batch, batch_idx):
        self.outputs.append(out)


def test_groups_train_the_actor_with_the_kl_in_the_loss(saved_models, tokenizer):
    torch.manual_seed(0)
    m = make(saved_models, tokenizer)
    m.configure_model()
    assert "reference" in m.frozen and m.critic is None
    actor0 = {k: v.clone() for k, v in m.actor.state_dict().items()}
    keep = Keep()
    trainer = fit(m, data(tokenizer), 2, callbacks=[keep])
    assert trainer.global_step == 2 and m.rl_iteration == 2  # fused: one optimizer step per iteration
    for name, p in m.actor.named_parameters():
        assert not torch.equal(actor0[name], p.detach()), name
    rollout = keep.outputs[-1]["rollout"]
    assert rollout.scores.shape == (16,) and rollout.prompts_text[:4] == [rollout.prompts_text[0]] * 4  # a group
    for key in ("policy/loss", "policy/clipfrac_low", "policy/clipfrac_high", "policy/kl_loss", "grpo/zero_std_groups"):
        assert key in trainer.callback_metrics and math.isfinite(float(trainer.callback_metrics[key])), key


def test_beta_zero_still_monitors_the_kl_unless_switched_off(saved_models, tokenizer):
    """β = 0 (DAPO): the reference is loaded to measure KL to the starting policy (no KL term in
    the loss); algo.monitor_kl=false builds none and the rollout has no reference log-probs."""
    from lit_rlhf.core.kl import sequence_kl

    m = make(saved_models, tokenizer, kl_coef=0.0)
    keep = Keep()
    trainer = fit(m, data(tokenizer), 1, callbacks=[keep])
    r = keep.outputs[0]["rollout"]
    assert "reference" in m.frozen and r.ref_logprobs is not None and "policy/kl_loss" not in trainer.callback_metrics
    # one step from the same weights: the KL to the starting policy is measurable and small but not zero
    kl = sequence_kl(r.logprobs, r.ref_logprobs, r.response_mask, clamp=None)
    assert torch.isfinite(kl).all() and float(kl.abs().max()) < 1e-4

    off = make(saved_models, tokenizer, kl_coef=0.0, monitor_kl=False)
    keep = Keep()
    trainer = fit(off, data(tokenizer), 1, callbacks=[keep])
    assert "reference" not in off.frozen and keep.outputs[0]["rollout"].ref_logprobs is None
    assert [n for n, _, _ in CriticFreeModule.planned_models(off.config)] == ["actor", "reward model"]
    assert [n for n, _, _ in CriticFreeModule.planned_models(m.config)] == ["actor", "reference", "reward model"]


def test_a_rollback_raises_the_beta_that_the_next_loss_uses(saved_models, tokenizer, monkeypatch):
    """β has one source: after the collapse alarm rolls back (β 0.04 -> 0.12), the next
    iteration's loss is the surrogate + 0.12 × its KL term, and kl_ctl/beta logs 0.12."""
    from lit_rlhf.callbacks.collapse import CollapseAlarm

    m = make(saved_models, tokenizer, kl_coef=0.04)
    alarm = CollapseAlarm(action="rollback", beta_factor=3.0, snapshot_every=1)
    monkeypatch.setattr(alarm.detector, "observe", lambda metrics: ["forced"] if m.rl_iteration == 2 else [])
    seen, real = [], m.minibatch_loss

    def spy(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        seen.append((m.rl_iteration, float(loss), float(stats["policy/loss"]), float(stats["policy/kl_loss"])))
        return loss, stats

    monkeypatch.setattr(m, "minibatch_loss", spy)
    trainer = fit(m, data(tokenizer), 3, callbacks=[alarm])
    assert [s[0] for s in seen] == [0, 1, 2] and len(alarm.triggers) == 1
    for iteration, loss, surrogate, kl in seen:
        beta = 0.04 if iteration < 2 else 0.12
        assert kl >= 0 and loss == pytest.approx(surrogate + beta * kl, rel=1e-5, abs=1e-9), (iteration, beta)
    assert seen[-1][3] > 1e-6  # the policy has moved: the raised β weighs a real KL term
    assert m.kl_coef == pytest.approx(0.12) and float(trainer.callback_metrics["kl_ctl/beta"]) == pytest.approx(0.12)


def test_fusion_follows_the_switch_and_the_dropout_guard(saved_models, tokenizer):
    """The fused first forward (RLModule.fused_first_forward) is one rule for every RL stage."""
    m = make(saved_models, tokenizer)
    m.configure_model()
    assert m.fused_first_forward(16)
    assert not make(saved_models, tokenizer, fuse_first_forward=False).fused_first_forward(16)
    assert not make(saved_models, tokenizer, num_iterations=2).fused_first_forward(16)
    assert not make(saved_models, tokenizer, minibatch_size=8).fused_first_forward(16)
    m.actor.config.attention_dropout = 0.1
    assert not m.fused_first_forward(16)


def test_advantages_are_the_group_relative_rewards_on_every_token(saved_models, tokenizer):
    """Independent check: from the rollout's own scores, per group (mean, unbiased std)."""
    import statistics

    m = make(saved_models, tokenizer, reward_fn=GOLD)
    keep = Keep()
    fit(m, data(tokenizer), 1, callbacks=[keep])
    r = keep.outputs[0]["rollout"]
    scores = r.scores.tolist()
    for i in range(16):
        grp = scores[i // 4 * 4 : i // 4 * 4 + 4]
        sd = statistics.stdev(grp)
        expected = 0.0 if sd == 0 else (scores[i] - statistics.mean(grp)) / (sd + 1e-4)
        row = r.advantages[i][r.response_mask[i].bool()]
        torch.testing.assert_close(row, torch.full_like(row, expected), atol=1e-5, rtol=1e-5)


def test_dynamic_sampling_keeps_only_groups_with_a_signal(saved_models, tokenizer):
    """A reward that is equal inside every second prompt's group: those groups are dropped, more
    prompts are drawn from the module's own stream, and the counts are logged."""
    m = make(
        saved_models,
        tokenizer,
        reward_fn={"_target_": "tests.modules.test_grpo_module.half_flat_reward"},
        dynamic_sampling=True,
        max_resample_rounds=3,
    )
    keep = Keep()
    trainer = fit(m, data(tokenizer), 1, callbacks=[keep])
    r = keep.outputs[0]["rollout"]
    assert r.scores.shape == (16,)
    groups = r.scores.view(4, 4)
    assert all(len(set(g.tolist())) > 1 for g in groups)  # every kept group has a signal
    cm = trainer.callback_metrics
    assert float(cm["grpo/dropped_groups"]) >= 2 and float(cm["grpo/resample_rounds"]) >= 1 and m.extra_batches >= 1
    assert float(cm["grpo/kept_groups"]) == 4 and float(cm["grpo/zero_std_groups"]) == 0


def half_flat_reward():
    """Rewards equal within the groups of prompts with an even character sum (deterministic), varied otherwise."""

    def fn(prompts, responses, ended):
        return [
            0.0 if sum(map(ord, p)) % 2 == 0 else float(len(r)) + 0.1 * i
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]

    return fn


def test_weighted_reward_callables_are_logged_by_name(saved_models, tokenizer):
    fns = [
        {**GOLD, "weight": 2.0, "name": "gold"},
        {"_target_": "tests.modules.test_grpo_module.length_reward", "weight": 0.5},
    ]
    m = make(saved_models, tokenizer, reward_fns=fns)
    keep = Keep()
    trainer = fit(m, data(tokenizer), 1, callbacks=[keep])
    comps = m.scorer.components
    torch.testing.assert_close(keep.outputs[0]["rollout"].scores, 2.0 * comps["gold"] + 0.5 * comps["length_reward"])
    assert {"reward/gold", "reward/length_reward"} <= set(trainer.callback_metrics)


def length_reward():
    return lambda prompts, responses, ended: [float(len(r.split())) for r in responses]


def bad_reward(kind):
    def fn(prompts, responses, ended):
        if kind == "raise":
            raise KeyError("no label")
        if kind == "short":
            return [0.0] * (len(responses) - 1)
        return [float("nan") if i % 4 == 0 else 1.0 + i for i in range(len(responses))]

    return fn


@pytest.mark.parametrize(
    "kind, message",
    [
        ("raise", r"reward function tests.modules.test_grpo_module.bad_reward raised KeyError"),
        ("short", r"returned 15 values for 16 responses"),
    ],
)
def test_a_broken_reward_callable_is_named(saved_models, tokenizer, kind, message):
    m = make(saved_models, tokenizer, reward_fn={"_target_": "tests.modules.test_grpo_module.bad_reward", "kind": kind})
    with pytest.raises(RewardFunctionError, match=message):
        fit(m, data(tokenizer), 1)


def test_non_finite_rewards_are_counted_and_skipped(saved_models, tokenizer):
    m = make(
        saved_models, tokenizer, reward_fn={"_target_": "tests.modules.test_grpo_module.bad_reward", "kind": "nan"}
    )
    keep = Keep()
    trainer = fit(m, data(tokenizer), 2, callbacks=[keep])
    assert float(trainer.callback_metrics["health/nonfinite_scores"]) == 4  # one per group of 4
    assert all(torch.isfinite(p).all() for p in m.actor.parameters())
    r = keep.outputs[-1]["rollout"]
    assert (r.advantages[~torch.isfinite(r.scores)] == 0).all()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_generations": 1}, r"algo.num_generations: GRPO compares responses within a group: needs >= 2"),
        (
            {"num_generations": 3, "rollout_batch_size": 16},
            r"algo.rollout_batch_size: 16 responses do not split into groups of algo.num_generations=3",
        ),
        ({"clip_eps_high": 0.1}, r"algo.clip_eps_high: must be >= algo.clip_eps_low"),
        ({"overlong_buffer": 300}, r"algo.overlong_buffer: must not exceed"),
    ],
)
def test_bad_values_name_the_keys(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(CriticFreeConfig, {"reward_path": "/rm", **values}, "algo")


def test_presets_are_values_of_one_config(tmp_path):
    from lit_rlhf.launch.runner import plan
    from tests.conftest import compose

    base = ["model=llama7b", "algo.reward_path=/rm"]
    grpo, dapo, dr, rloo = (
        plan(compose([f"algo={a}", *base], tmp_path)).algo for a in ("grpo", "dapo", "dr_grpo", "rloo")
    )
    assert (grpo.kl_coef, grpo.loss_aggregation, grpo.scale_rewards, grpo.num_generations) == (
        0.04,
        "seq_mean_token_mean",
        True,
        8,
    )
    assert (dapo.clip_eps_high, dapo.loss_aggregation, dapo.kl_coef, dapo.dynamic_sampling, dapo.overlong_buffer) == (
        0.28,
        "token_mean",
        0.0,
        True,
        64,
    )
    assert (dr.scale_rewards, dr.loss_aggregation, rloo.advantage_baseline, rloo.scale_rewards) == (
        False,
        "seq_sum_constant",
        "leave_one_out",
        False,
    )
    assert plan(compose(["algo=grpo", *base], tmp_path)).data.batch_size == 4  # 32 responses = 4 prompts x 8


def test_checkpoint_resumes_the_dynamic_sampling_stream(saved_models, tokenizer, tmp_path):
    kw = dict(reward_fn={"_target_": "tests.modules.test_grpo_module.half_flat_reward"}, dynamic_sampling=True)
    m = make(saved_models, tokenizer, **kw)
    trainer = fit(m, data(tokenizer), 2, default_root_dir=tmp_path)
    trainer.save_checkpoint(tmp_path / "grpo.ckpt")
    state = torch.load(tmp_path / "grpo.ckpt", weights_only=True)["lit_rlhf_rl"]
    assert state["extra_batches"] == m.extra_batches > 0 and state["iteration"] == 2
    resumed = make(saved_models, tokenizer, **kw)
    t2 = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    t2.fit(resumed, data(tokenizer), ckpt_path=tmp_path / "grpo.ckpt")
    assert resumed.rl_iteration == 3 and resumed.extra_batches > state["extra_batches"]


class AnswerChecker:
    """A verifier-shaped reward: 1.0 when the ground truth handed with a prompt is that prompt's (its
    word count, as written in the file); every third call's first response "cannot be checked"
    (scored 0, counted in ``last_errors`` as lit_rlhf.rewards' verifiers do)."""

    seen: list = []

    def __init__(self):
        self.calls, self.last_errors, self.last_error_example = 0, 0, None

    def __call__(self, prompts, responses, ended, answer, **_):
        self.calls += 1
        AnswerChecker.seen.append((list(prompts), list(answer)))
        out = [float(a == str(len(p.split()))) for p, a in zip(prompts, answer)]
        self.last_errors = int(self.calls % 3 == 0)
        self.last_error_example = "could not parse" if self.last_errors else None
        if self.last_errors:
            out[0] = 0.0
        return out


def test_ground_truth_reaches_the_reward_with_each_prompt_and_errors_are_counted(saved_models, tokenizer, tmp_path):
    """data.prompt.answer_field: each prompt's answer travels with it through the loader, the G-fold
    repeat of GRPO and DAPO's resampling, to the reward callable (keyword ``answer``) and to the
    validation's gold reward; a verifier's unchecked responses are logged as reward/<name>_errors."""
    import json

    from lit_rlhf.data.synthetic import SyntheticTask

    prompts = [r["prompt"] for r in SyntheticTask().prompts(40, "train")]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": p, "answer": len(p.split())}) + "\n" for p in prompts))
    dm = PromptDataModule(
        source=str(path),
        prompt_field="question",
        answer_field="answer",
        val_rows="33-40",
        train_rows="1-32",
        batch_size=4,
    ).connect(tokenizer)
    checker = {"_target_": "tests.modules.test_grpo_module.AnswerChecker", "name": "acc"}
    m = make(
        saved_models,
        tokenizer,
        reward_fns=[checker],
        gold_reward_fn={"_target_": checker["_target_"]},
        dynamic_sampling=True,
        max_resample_rounds=1,
        val_pass_k=2,
    )
    AnswerChecker.seen = []
    keep = Keep()
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        val_check_interval=1,
        limit_val_batches=1,
        callbacks=[keep],
    )
    trainer.fit(m, dm)
    assert len(AnswerChecker.seen) >= 3 + 3  # 3 iterations (+ resampling rounds) and validation batches
    for ps, answers in AnswerChecker.seen:
        assert answers == [str(len(p.split())) for p in ps]  # every answer is its own prompt's, rows aligned
    scores = keep.outputs[-1]["rollout"].scores
    assert set(scores.tolist()) <= {0.0, 1.0} and scores.sum() >= scores.numel() - 1
    assert "reward/acc_errors" in trainer.callback_metrics and "reward/acc" in trainer.callback_metrics
    assert float(trainer.callback_metrics["val/gold_score_mean"]) > 0.9  # the gold scorer got the answers too
    # algo.val_pass_k: greedy and k = 2 samples per validation prompt, judged by the gold scorer
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    assert {"val/greedy_accuracy", "val/greedy_length", "val/pass@2", "val/mean@2"} <= set(metrics)
    assert 1.0 >= metrics["val/pass@2"] >= metrics["val/mean@2"] > 0.8 and metrics["val/greedy_accuracy"] > 0.8


def test_answer_fields_are_read_and_checked(tokenizer, tmp_path):
    import json

    from lit_rlhf.data.io import DataError

    rows = [{"q": "the cat", "a": "Natalia sold 48 clips ... #### 72"}, {"q": "a dog", "a": "so 3 + 4 = 7\n#### 7 "}]
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(source=str(path), prompt_field="q", answer_field="a", answer_format="gsm8k", batch_size=2)
    dm.connect(tokenizer).setup()
    batch = next(iter(dm.train_dataloader()))
    assert sorted(zip(batch["prompts"], batch["columns"]["answer"])) == [("a dog", "7"), ("the cat", "72")]
    path.write_text(json.dumps({"q": "x", "a": "no marker"}) + "\n")
    with pytest.raises(DataError, match=r"gsm.jsonl:1: answer field 'a' has no '#### <answer>' line"):
        PromptDataModule(
            source=str(path), prompt_field="q", answer_field="a", answer_format="gsm8k", batch_size=1
        ).connect(tokenizer).setup()
    path.write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    with pytest.raises(
        DataError, match=r"missing answer field 'a' \(data.prompt.answer_field\); the row has: answer, q"
    ):
        PromptDataModule(source=str(path), prompt_field="q", answer_field="a", batch_size=1).connect(tokenizer).setup()


def test_a_list_answer_field_is_several_acceptable_answers(tokenizer, tmp_path):
    import json

    from lit_rlhf.data.io import DataError

    rows = [{"q": "the cat", "a": ["5", 10, 2.5]}, {"q": "a dog", "a": "7"}]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(source=str(path), prompt_field="q", answer_field="a", batch_size=2)
    dm.connect(tokenizer).setup()
    batch = next(iter(dm.train_dataloader()))
    assert sorted(zip(batch["prompts"], batch["columns"]["answer"]), key=lambda r: r[0]) == [
        ("a dog", "7"),
        ("the cat", ["5", "10", "2.5"]),  # each entry as text, the list kept whole through collation
    ]
    for bad, says in (([], r"qa.jsonl:1: answer field 'a' is an empty list"), (["5", {"x": 1}], r"'a\[1\]' must be")):
        path.write_text(json.dumps({"q": "x", "a": bad}) + "\n")
        with pytest.raises(DataError, match=says):
            PromptDataModule(source=str(path), prompt_field="q", answer_field="a", batch_size=1).connect(
                tokenizer
            ).setup()


def test_a_failed_async_fit_leaves_no_producer_behind(saved_models, tokenizer):
    """Lightning tears a module down only after a fit that ends; a fit that fails (here the reward
    callable raises in iteration 2) still stops its rollout producer process and gives the trainer
    its torch threads back (lit_rlhf/modules/base.py ``TeardownOnFailure``), so a retry in the same
    process starts a producer of its own (and ends with it stopped, as a fit that ends does). While
    the producer runs, the trainer validates with all of its threads, and trains with the rest."""
    fails = {"_target_": "tests.helpers.producer_faults.reward_failing_at", "call": 2}
    m = make(saved_models, tokenizer, reward_fn=fails, rollout={"mode": "async"}, rollout_correction="decoupled")
    threads, seen = torch.get_num_threads(), []

    class Producer(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(module.producer.process)

    with pytest.raises(Exception, match="the grader is broken"):
        fit(m, data(tokenizer), 3, callbacks=[Producer()])
    assert len(seen) == 1 and seen[0].exitcode is not None  # the producer of the failed fit has exited
    assert m.producer is None and torch.get_num_threads() == threads
    # the retry (the reward's calls 3 and 4 succeed) with 2 threads, validating after each iteration:
    # the producer starts in the first and takes one of them, and validation samples with both
    # (set_num_threads: in a test worker that ran a CPU vLLM engine, torch.set_num_threads is vLLM's no-op)
    from lit_rlhf.utils.compat.torch import set_num_threads

    used = []

    class Threads(pl.Callback):  # the trainer's torch threads while it trains, and while it validates
        def on_train_start(self, trainer, module):
            set_num_threads(2)  # the run's threads, which the producer's start splits at the first iteration

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            used.append(("train", torch.get_num_threads()))

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            if not trainer.sanity_checking:
                used.append(("val", torch.get_num_threads()))

    try:
        fit(m, data(tokenizer), 2, callbacks=[Producer(), Threads()], limit_val_batches=1, val_check_interval=1)
        assert m.producer is None and torch.get_num_threads() == 2
    finally:
        set_num_threads(threads)
    assert len(seen) == 3 and seen[1] is seen[2] is not seen[0] and seen[1].exitcode is not None
    assert used == [("train", 2), ("val", 2), ("train", 1), ("val", 2)], used


def test_an_async_fit_without_shared_memory_for_the_weights_stops_before_it_starts(
    saved_models, tokenizer, monkeypatch
):
    """The producer gets the policy's weights through /dev/shm, where writing past its size kills a
    process with SIGBUS (a container's is 64 MB): a host whose shared memory cannot hold them stops
    the fit with an error naming the key and the sizes, before any producer starts."""
    import os
    from types import SimpleNamespace

    m = make(saved_models, tokenizer, rollout={"mode": "async"}, rollout_correction="decoupled")
    threads, real = torch.get_num_threads(), os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096) if path == "/dev/shm" else real(path)
    )
    with pytest.raises(
        ConfigError, match=r"algo.rollout.mode: .* need [0-9.]+ MiB of /dev/shm, which has 0.0 MiB free"
    ):
        fit(m, data(tokenizer), 2)
    assert m.producer is None and torch.get_num_threads() == threads
