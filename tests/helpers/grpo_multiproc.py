"""Run a few GRPO iterations under DDP, (CPU) DeepSpeed or (CPU) FSDP with N processes; each rank writes
its final actor parameters and metrics to OUT/rank<r>.pt.

    python tests/helpers/grpo_multiproc.py --strategy ddp --devices 2 --models DIR --out DIR [--dapo | --preset P]

``--dapo``: dynamic sampling with a reward that differs by rank (:func:`uneven_reward`), so the
ranks need different numbers of extra prompt batches and keep different numbers of groups.
``--agent``: multi-turn rollouts of the guessing game (``--models`` is then a policy folder with the
multi-turn tasks' chat tokenizer), over after one guess on rank 0 (:class:`RankGame`): rank 0
samples placeholders while rank 1 plays on.
``--async``: asynchronous rollouts at bound 1 (every rank's own producer process), 4 iterations;
``--kill-producer``: rank 1's producer is SIGKILLed as the third iteration starts.
``--preset reinforce_pp`` (one response per prompt, the KL in the reward, advantages whitened over
all ranks, 2 minibatches) or ``--preset remax`` (the greedy baseline decoded on every rank): each
rank also writes its last rollout's advantage sums and its baselines.

Run as a script: Lightning's subprocess launcher re-executes it once per extra rank.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers importable when run as a script

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lit_rlhf.data.agent_tasks import GuessNumber  # noqa: E402
from lit_rlhf.data.prompts import PromptDataModule  # noqa: E402
from lit_rlhf.data.tokenizers import build_tokenizer  # noqa: E402
from lit_rlhf.launch.presets import preset  # noqa: E402
from lit_rlhf.models.spec import ModelSpec  # noqa: E402
from lit_rlhf.modules.configs import CriticFreeConfig  # noqa: E402
from lit_rlhf.modules.critic_free import CriticFreeModule  # noqa: E402
from lit_rlhf.utils.config import build_config  # noqa: E402
from tests.helpers.cpu_strategies import (  # noqa: E402
    cpu_strategy,
    multiproc_args,
    run_parser,
    whole_weights,
    wrapper_name,
)


def uneven_reward():
    """A reward callable (``algo.reward_fn``) for 2 ranks of 2 groups of 4: on rank 0 every group
    has a signal; on rank 1 only the second group of an iteration's first batch does, every extra
    batch is flat. So rank 0 has its groups at once, rank 1 stays short through every extra round
    and ends with 1 group."""
    import zlib

    calls = [0]

    def reward(prompts, responses, ended=None):
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        first = calls[0] % 3 == 0  # max_resample_rounds = 2: 3 batches per iteration on every rank
        calls[0] += 1
        varied = [float(zlib.crc32(f"{i}{r}".encode()) % 97) for i, r in enumerate(responses)]
        if rank == 0:
            return varied
        return [v if first and i >= 4 else 0.0 for i, v in enumerate(varied)]

    return reward


class RankGame(GuessNumber):
    """The guessing game, over after the first guess on rank 0 (scored by how close it was): rank 0's
    games end at once while rank 1's go on, so rank 0 samples placeholders for rank 1's later turns."""

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            numbers = [int(w) for w in text.split() if w.isdigit()]
            return None, -abs(numbers[-1] - self.secret) if numbers else -20.0, True
        return super().step(text)


PARSER = run_parser(
    "folder with policy/ and rm/",
    [
        ("--dapo", {"action": "store_true"}),
        ("--preset", {"choices": ["reinforce_pp", "remax"], "default": None}),
        ("--engine", {"choices": ["hf", "vllm"], "default": "hf"}),
        ("--agent", {"action": "store_true"}),
        ("--async", {"action": "store_true", "dest": "asynchronous"}),
        ("--kill-producer", {"action": "store_true"}),
    ],
)


def main() -> None:
    torch.set_num_threads(1)
    for args in multiproc_args(PARSER):
        run(args)


def run(args) -> None:
    policy, rm = os.path.join(args.models, "policy"), os.path.join(args.models, "rm")
    if args.agent:
        policy = args.models
    reward = (
        {
            "reward_fn": {"_target_": "lit_rlhf.rewards.environment_reward"},
            "environment": {"_target_": "tests.helpers.grpo_multiproc.RankGame"},
            "max_turns": 4,
        }
        if args.agent
        else {
            "reward_fn": {"_target_": "tests.helpers.grpo_multiproc.uneven_reward"},
            "dynamic_sampling": True,
            "max_resample_rounds": 2,
        }
        if args.dapo
        else {"reward_path": rm}
    )
    # GRPO with groups of 4, μ = 2 passes of 2 minibatches; the REINFORCE++ preset has 2 minibatches of 4
    algo = {"num_generations": 4, "minibatch_size": 4, "num_iterations": 2} if args.preset is None else {}
    if args.dapo:  # and accumulated over micro-batches of 2 under DDP (each backward all-reduces)
        algo["micro_batch_size"] = 2
    if args.asynchronous:  # every rank's producer one policy version ahead; 4 iterations of one pass, so
        # that the producer samples with published weights (bound 1: ticket k from version ≥ k − 1)
        algo.update(rollout={"mode": "async", "max_staleness": 1}, rollout_correction="decoupled", num_iterations=1)
    engine = {"engine": args.engine, "vllm": {"kv_cache_gib": 0.0625}}
    cfg = build_config(
        CriticFreeConfig,
        preset(
            args.preset or "grpo",
            {
                "policy_path": policy,
                "lr": 1e-3,
                "rollout_batch_size": 8,
                "monitor_sampler": args.engine == "vllm",
                "generation": {"max_new_tokens": 32 if args.agent else 6, **engine},
                **algo,
                **reward,
            },
        ),
        "algo",
    )
    spec = CriticFreeModule.resolve_model_spec(cfg, ModelSpec(name_or_path=policy))
    tok = build_tokenizer(spec)
    module = CriticFreeModule(cfg, model=spec, tokenizer=tok)
    game = {"source": "guess", "template": "auto"} if args.agent else {}
    data = PromptDataModule(n_train=64, n_val=0, batch_size=8 // cfg.num_generations, **game).connect(tok)
    strategy = cpu_strategy(args.strategy, micro_batch=4)
    wrapper, sampling, last, games = [], [], {}, []

    class Wrapper(pl.Callback):  # the strategy's wrapper during fit (teardown unwraps DDP)
        def on_train_start(self, trainer, module):
            wrapper.append(wrapper_name(trainer, module.actor))

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if args.kill_producer and trainer.global_rank == 1 and module.rl_iteration == 2:
                os.kill(module.producer.process.pid, signal.SIGKILL)  # this rank alone restarts it

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            st, r = outputs["stats"], outputs["rollout"]
            kept = ("grpo/kept_groups", "grpo/resample_rounds", "async/staleness")
            sampling.append({k: float(st[k]) for k in kept if k in st})
            if module.producer is not None:  # this rank's own count (the logged one is over the ranks)
                last["restarted"] = module.producer.restarted
            m = r.response_mask.float()  # this rank's masked sum, sum of squares and count of the advantages
            last.update(
                advantages=[float((r.advantages * m).sum()), float((r.advantages**2 * m).sum()), float(m.sum())],
                baselines=None if r.baseline_scores is None else r.baseline_scores.tolist(),
                prompts=list(r.prompts_text),
                sampler_kl=float(st.get("rollout/sampler_kl", -1.0)),
            )
            if "turns" in r.columns:  # this rank's own games (the logged statistics are over both ranks)
                games.append({"secrets": r.columns["secret"], "turns": r.columns["turns"]})

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[Wrapper()],
    )
    trainer.fit(module, data)
    with whole_weights(trainer, module):
        params = {k: v.detach().float().cpu().clone() for k, v in module.actor.state_dict().items()}
    torch.save(
        {
            "params": params,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "iteration": module.rl_iteration,
            "wrapper": wrapper[0],
            "sampling": sampling,
            "extra_batches": module.extra_batches,
            "games": games,
            **last,
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
