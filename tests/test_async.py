"""Asynchronous rollouts through train.py's path (lit_rlhf.launch.runner.run on the composed config;
docs/async.md): at bound 0 an async run IS the synchronous one (weights, optimizer state and every
training metric; PPO-max with its critic and minibatches and the reference scored by the producer;
DAPO with its resampling and a producer killed for good, stopped with a checkpoint and resumed); at
bound 1 every stage trains with its staleness logged and bounded (PPO-max, ReMax's greedy baseline,
GRPO with the calculator's multi-turn rollouts; GRPO and PPO-max multi-turn with the vLLM engine
too), the first two rollouts sampled as one merged batch, PPO-max resuming from a checkpoint to the
same end of the step budget; and a ``train.py`` in
async mode killed with SIGKILL resumes to the synchronous run's end (bound 0)."""

from __future__ import annotations

import csv

import pytest

from lit_rlhf.launch.runner import run
from lit_rlhf.modules.configs import CriticFreeConfig
from lit_rlhf.rollout.producer import ProducerError
from lit_rlhf.utils.config import ConfigError, build_config
from tests.conftest import compose
from tests.test_agent import overrides as agent_overrides
from tests.test_resume import EVERY_BATCH, assert_same_end, kill_and_resume, load, stage_overrides

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("async_runs")]
CORRECTED = ["algo.rollout_correction=decoupled"]
ASYNC = ["algo.rollout.mode=async", *CORRECTED]


def same_metrics(a: dict, b: dict) -> dict:
    """The metrics of ``a`` that differ from ``b``'s (timings and the producer's own left out)."""
    keys = {k for k in (*a, *b) if not k.startswith(("perf/", "async/"))}
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_bound_zero_is_the_synchronous_run(stage, tmp_path, saved_models):
    """PPO-max with the reference scored by the producer. DAPO with the trainer scoring it, and a
    producer gone for good: SIGKILLed during iteration 1 by the reward callable
    (tests/helpers/producer_faults.py) with ``algo.rollout.restarts=0``, iteration 2 stops with an error
    naming the key and a ``last.ckpt`` that redoes it; ``ckpt_path=last`` (a new producer) still ends
    where the synchronous run ends, its validations the same and at the same steps."""
    base = [*stage_overrides(stage, saved_models), *EVERY_BATCH, "trainer.max_epochs=1", "logger=csv"]
    if stage == "ppo":  # under autocast: the producer samples and scores under the training step's too
        base.append("trainer.precision=bf16-mixed")
    marker = tmp_path / "killed"
    if stage == "grpo":
        killer = f"algo.reward_fn={{_target_: tests.helpers.producer_faults.producer_killer, marker: '{marker}'}}"
        base += [killer, "algo.reward_path=null"]
    sync = run(compose([*base, *CORRECTED], tmp_path / "sync"))
    where = [f"algo.rollout.reference_scoring={'producer' if stage == 'ppo' else 'trainer'}", "algo.rollout.restarts=0"]
    overrides = [*base, *ASYNC, "algo.rollout.max_staleness=0", *where]
    if stage == "grpo":
        assert not marker.exists()  # no producer to kill in a synchronous run
        stop = r"algo.rollout.restarts=0.*checkpoint: .*last.ckpt \(ckpt_path=last redoes it\)"
        with pytest.raises(ProducerError, match=stop):
            run(compose(overrides, tmp_path / "async"))
        assert marker.exists() and load(tmp_path / "async" / "checkpoints" / "last.ckpt")["global_step"] == 2
        overrides.append(f"ckpt_path={tmp_path / 'async' / 'checkpoints' / 'last.ckpt'}")
    asynchronous = run(compose(overrides, tmp_path / "async"))
    final = load(tmp_path / "sync" / "checkpoints" / "last.ckpt")
    assert_same_end(load(tmp_path / "async" / "checkpoints" / "last.ckpt"), final, f"{stage} async at bound 0")
    assert not same_metrics(asynchronous, sync)  # validation included
    # the resumed run validates and logs at the uninterrupted run's steps; its csv keeps the interrupted run's rows
    assert val_rows(tmp_path / "async") == val_rows(tmp_path / "sync")
    assert asynchronous["async/staleness"] == 0


def val_rows(folder) -> list[tuple[str, str]]:
    """(step, val/score_mean) of each validation in ``folder``'s metrics.csv."""
    with open(next(folder.rglob("metrics.csv"))) as fh:
        return [(r["step"], r["val/score_mean"]) for r in csv.DictReader(fh) if r.get("val/score_mean")]


def rows_of(folder) -> list[dict]:
    with open(next(folder.rglob("metrics.csv"))) as fh:
        return [r for r in csv.DictReader(fh) if r.get("async/staleness")]


VLLM = ["algo.generation.engine=vllm", "algo.generation.vllm.kv_cache_gib=0.0625"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ppo", "remax", "agent", "agent_vllm", "agent_ppo_vllm"])
def test_every_stage_trains_at_bound_one_and_resumes(stage, tmp_path, saved_models, agent_policy_dir):
    """``*_vllm``: the producer samples with a vLLM engine of its own (GRPO's and PPO-max's
    multi-turn rollouts with the calculator). Every stage with ``merge_rollouts=2`` (the first two
    rollouts sampled as one batch). PPO-max (hf) also resumes; the others take the same path."""
    if stage.startswith("agent"):  # the calculator: multi-turn rollouts sampled by the producer
        algo = {"agent": "grpo", "agent_vllm": "grpo_vllm", "agent_ppo_vllm": "ppo_max"}[stage]
        base = [*agent_overrides(algo, agent_policy_dir), *ASYNC, *(VLLM if stage == "agent_ppo_vllm" else [])]
    else:
        base = [*stage_overrides(stage, saved_models), *EVERY_BATCH, "logger=csv", "trainer.max_epochs=1", *ASYNC]
    base += ["algo.rollout.max_staleness=1", "algo.rollout.reference_scoring=balanced", "algo.rollout.merge_rollouts=2"]
    full = tmp_path / "full"
    metrics = run(compose(base, full))
    rows = rows_of(full)
    staleness = [float(r["async/staleness"]) for r in rows]
    assert staleness[0] == 0 and max(staleness) == 1 and set(staleness) <= {0.0, 1.0}
    assert all(float(r["async/staleness_0"]) + float(r["async/staleness_1"]) == 1 for r in rows)
    assert metrics["async/restarts"] == 0
    # reference_scoring=balanced: a share of each sample's rows scored by the producer, the rest by the trainer
    assert all(0.0 <= float(r["async/producer_reference"]) <= 1.0 for r in rows)
    # merge_rollouts=2: the first two tickets, handed out together before the producer has started,
    # are sampled as one batch (and cut back into each iteration's rollout)
    merged = [float(r["async/producer_merged"]) for r in rows]
    assert merged[:2] == [2.0, 2.0] and set(merged) <= {1.0, 2.0}
    if stage.startswith("agent"):
        assert max(float(r["agent/tool_calls"]) for r in rows_of(full) if r.get("agent/tool_calls")) > 0
    if stage != "ppo":
        return
    final = load(full / "checkpoints" / "last.ckpt")
    ckpts = sorted((full / "checkpoints").glob("b*.ckpt"))
    resumed = tmp_path / "resumed"
    run(compose([*base, f"ckpt_path={ckpts[1]}"], resumed))
    end = load(resumed / "checkpoints" / "last.ckpt")
    # not the same weights: the resumed tickets are sampled by the checkpoint's, fresher, weights
    assert end["global_step"] == final["global_step"] and end["epoch"] == final["epoch"]
    assert (
        end["loops"]["fit_loop"]["epoch_loop.batch_progress"] == final["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    )


@pytest.mark.slow
def test_sigkilled_async_train_py_resumes_to_the_synchronous_end(tmp_path, saved_models):
    """PPO-max at bound 0 as a user runs it: ``python train.py … algo.rollout.mode=async`` killed with
    SIGKILL after its second checkpoint (producer and all), then resumed with ``ckpt_path``: it ends
    with the weights of the synchronous run never interrupted."""
    overrides = [*stage_overrides("ppo", saved_models), *EVERY_BATCH, *CORRECTED]
    run(compose(overrides, tmp_path / "sync"))
    final = load(tmp_path / "sync" / "checkpoints" / "last.ckpt")
    overrides = [*overrides, *ASYNC, "algo.rollout.max_staleness=0"]
    killed_at = kill_and_resume(overrides, tmp_path / "killed", final["global_step"])
    end = load(tmp_path / "killed" / "checkpoints" / "last.ckpt")
    assert_same_end(end, final, f"async ppo_max killed at step {killed_at}")


def test_async_needs_a_correction_an_unsplit_vllm_engine_and_a_reachable_merge():
    base = {"reward_fn": {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}, "rollout": {"mode": "async"}}
    with pytest.raises(ConfigError, match=r"algo.rollout_correction.*name the correction"):
        build_config(CriticFreeConfig, base, "algo")
    with pytest.raises(ConfigError, match=r"algo.rollout.max_staleness"):
        build_config(CriticFreeConfig, {**base, "rollout": {"mode": "async", "max_staleness": -1}}, "algo")
    assert build_config(CriticFreeConfig, {**base, "rollout_correction": "tis"}, "algo").rollout.max_staleness == 1
    # the producer's vLLM engine samples alone: no ranks to split the model over
    tp = {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}
    with pytest.raises(ConfigError, match=r"algo\.generation\.vllm\.tensor_parallel_size: an async"):
        build_config(CriticFreeConfig, {**base, "rollout_correction": "tis", "generation": tp}, "algo")
    assert build_config(CriticFreeConfig, {**base, "rollout": {"mode": "sync"}, "generation": tp}, "algo")
    # a merged batch holds at most the rollouts the bound admits at once
    merge = {"rollout_correction": "tis", "rollout": {"mode": "async", "max_staleness": 1, "merge_rollouts": 3}}
    with pytest.raises(ConfigError, match=r"algo\.rollout\.merge_rollouts: .*max_staleness \+ 1 = 2 .*; got 3"):
        build_config(CriticFreeConfig, {**base, **merge}, "algo")
    merge["rollout"]["merge_rollouts"] = 2
    assert build_config(CriticFreeConfig, {**base, **merge}, "algo").rollout.merge_rollouts == 2
    synchronous = {"rollout": {"mode": "sync", "max_staleness": 1, "merge_rollouts": 3}}  # no producer: no merging
    assert build_config(CriticFreeConfig, {**base, **synchronous}, "algo").rollout.merge_rollouts == 3


def test_a_sharded_lora_policys_reference_is_scored_by_the_trainer_only(saved_models, tokenizer):
    """Under ZeRO-3 a LoRA policy's frozen reference is the policy itself with its adapters off, whose
    weights are partitions (a rank holds its part only, outside a gather): the producer cannot score
    it, and a run that asks it to stops naming the key before any producer starts. On a device other
    than the CPU or a CUDA GPU async stops naming algo.rollout.mode; on a GPU, a producer asked to
    score the reference stops naming that key."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lit_rlhf.models.lora import AdaptersDisabled
    from lit_rlhf.models.spec import LoraSpec, ModelSpec
    from lit_rlhf.modules.critic_free import CriticFreeModule

    algo = {
        "policy_path": saved_models[0],
        "reward_fn": {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"},
        "kl_coef": 0.1,
        "rollout": {"mode": "async", "reference_scoring": "balanced"},
        "rollout_correction": "decoupled",
    }
    cfg = build_config(CriticFreeConfig, algo, "algo")
    spec = ModelSpec(name_or_path=saved_models[0], lora=LoraSpec(enabled=True, r=4))
    m = CriticFreeModule(cfg, model=CriticFreeModule.resolve_model_spec(cfg, spec), tokenizer=tokenizer)
    m.configure_model()
    assert isinstance(m.frozen["reference"], AdaptersDisabled)
    m._trainer = SimpleNamespace(strategy=DeepSpeedStrategy(stage=3))
    with pytest.raises(ConfigError, match=r"rollout\.reference_scoring.*reference_scoring=trainer"):
        m.rollout_producer()
    assert m.producer is None
    m._device = torch.device("meta")
    with pytest.raises(ConfigError, match=r"algo\.rollout\.mode.*on the CPU or a CUDA GPU.*meta"):
        m.rollout_producer()
    # on a GPU (refused before anything touches it): the trainer scores the reference
    m._device, m._trainer = torch.device("cuda", 1), SimpleNamespace(strategy=DeepSpeedStrategy(stage=2))
    with pytest.raises(ConfigError, match=r"algo\.rollout\.reference_scoring: on a GPU only the trainer"):
        m.rollout_producer()
    assert m.producer is None
