"""Run a few PPO iterations under DDP, (CPU) DeepSpeed ZeRO-2/3 or (CPU) FSDP with N processes; each rank
writes its final actor/critic parameters and RL statistics to OUT/rank<r>.pt.

    python tests/helpers/ppo_multiproc.py --strategy ddp --devices 2 --models DIR --out DIR

With ``--ckpt-dir`` and ``--resume-into DIR2`` the same processes then run a second, fresh fit resumed
from the first one's step-2 checkpoint and write its ranks to DIR2 (the resume test without a second
launch of the processes); ``--then`` separates several runs of one launch (cpu_strategies.multiproc_args).

Run as a script: Lightning's subprocess launcher re-executes it once per extra rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers importable when run as a script

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lit_rlhf.callbacks.resume import ResumeState  # noqa: E402
from lit_rlhf.data.prompts import PromptDataModule  # noqa: E402
from lit_rlhf.data.tokenizers import build_tokenizer  # noqa: E402
from lit_rlhf.launch.presets import preset  # noqa: E402
from lit_rlhf.models.spec import ModelSpec  # noqa: E402
from lit_rlhf.modules.configs import PPOConfig  # noqa: E402
from lit_rlhf.modules.ppo import PPOModule  # noqa: E402
from lit_rlhf.utils.config import build_config  # noqa: E402
from tests.helpers.cpu_strategies import cpu_strategy, multiproc_args, run_parser, whole_weights  # noqa: E402


def fsdp(trainer) -> bool:
    from lit_rlhf.runtime.strategies import RLHFFSDPStrategy

    return isinstance(trainer.strategy, RLHFFSDPStrategy)


class Dump(pl.Callback):
    def __init__(self, out: str, policy: str) -> None:
        from transformers import AutoModelForCausalLM

        self.out = out
        self.full_shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_pretrained(policy).named_parameters()}

    def on_train_start(self, trainer, module) -> None:
        # strategies consume the global RNG differently while setting up (DeepSpeed's engine does):
        # the same seed here makes every strategy sample the same rollouts, so results compare
        torch.manual_seed(1234 + trainer.global_rank)

    def on_fit_start(self, trainer, module) -> None:
        # ZeRO-3/FSDP: per no-grad forward of the actor's first decoder layer (every decoding step
        # and scoring forward of the rollouts runs it), were ALL the actor's weights already whole?
        self.whole_weights = []
        actor = module.actor
        first_layer = actor.model.layers[0]  # (FSDP: found through the units' attribute forwarding)
        if getattr(trainer.strategy, "zero_stage_3", False):
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            def before_the_engine(mod, args, kwargs):  # prepended: runs before DeepSpeed's fetch hooks
                if not torch.is_grad_enabled():
                    self.whole_weights.append(all(p.ds_status == ZeroParamStatus.AVAILABLE for p in actor.parameters()))

            first_layer.register_forward_pre_hook(before_the_engine, prepend=True, with_kwargs=True)
        if fsdp(trainer) and trainer.world_size > 1:  # (one process: FSDP never shards)

            def before_the_unit(mod, args, kwargs):  # the layer's unit: before it would gather anything
                if not torch.is_grad_enabled():
                    self.whole_weights.append(
                        all(
                            p.shape == self.full_shapes[k.replace("_fsdp_wrapped_module.", "")]
                            for k, p in actor.named_parameters()
                        )
                    )

            assert type(actor).__name__ == type(first_layer).__name__ == "FullyShardedDataParallel"
            first_layer.register_forward_pre_hook(before_the_unit, prepend=True, with_kwargs=True)
        self.kl_inputs = []  # what the KL controller is fed each iteration: (sequence KL, samples)
        update = module.kl_ctl.update
        module.kl_ctl.update = lambda kl, n: self.kl_inputs.append((kl, n)) or update(kl, n)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        r = outputs["rollout"]
        m = r.response_mask.float()
        # the last rollout's whitened advantages on this rank: masked sum, sum of squares, count
        self.advantages = [float((r.advantages * m).sum()), float((r.advantages**2 * m).sum()), float(m.sum())]

    def on_train_end(self, trainer, module) -> None:
        with whole_weights(trainer, module):  # ZeRO-3's partitions, FSDP's shards gathered
            state = {f"actor.{k}": v.detach().float().cpu().clone() for k, v in module.actor.state_dict().items()}
            state.update(
                {f"critic.{k}": v.detach().float().cpu().clone() for k, v in module.critic.state_dict().items()}
            )
        torch.save(
            {
                "params": state,
                "moments": module.reward_moments.state_dict(),
                "global_step": trainer.global_step,
                "world_size": trainer.world_size,
                "iteration": module.iteration,
                "kl_ctl": module.kl_ctl.state_dict(),
                "kl_inputs": self.kl_inputs,
                "advantages": self.advantages,
                "whole_weights": self.whole_weights,
                "logged": {
                    k: float(v)
                    for k, v in trainer.callback_metrics.items()
                    if k.split("/")[0] in ("policy", "critic", "reward", "perf", "health", "kl_ctl")
                },
                "groups": [len(g["params"]) for g in trainer.optimizers[0].param_groups],  # matrices/vectors split
                "wrapper": type(module.actor if fsdp(trainer) else trainer.strategy.model).__name__,
                "zero_stage": trainer.strategy.model.zero_optimization_stage()
                if hasattr(trainer.strategy.model, "zero_optimization_stage")
                else None,
            },
            os.path.join(self.out, f"rank{trainer.global_rank}.pt"),
        )


PARSER = run_parser(
    "folder with policy/ and rm/",
    [
        ("--max-steps", {"type": int, "default": 4}),
        ("--ckpt-dir", {"help": "save a checkpoint every 2 optimizer steps here"}),
        ("--resume", {"help": "checkpoint to resume from"}),
        ("--resume-into", {"help": "then resume a fresh fit from the step-2 checkpoint in --ckpt-dir, ranks here"}),
        ("--export-dir", {"help": "export the actor here at the end of the fit (algo.export_dir)"}),
    ],
)


def main() -> None:
    torch.set_num_threads(1)
    for args in multiproc_args(PARSER):
        run(args)


def run(args) -> None:
    fit(args, args.out, args.resume, args.ckpt_dir, args.export_dir)
    if args.resume_into:  # a fresh module, data module and strategy: only the checkpoint carries the state
        ckpt = sorted(Path(args.ckpt_dir).glob("*step=2.ckpt"))
        assert len(ckpt) == 1, sorted(os.listdir(args.ckpt_dir))
        fit(args, args.resume_into, str(ckpt[0]), None, None)


def fit(args, out: str, resume: str | None, ckpt_dir: str | None, export_dir: str | None) -> None:
    os.makedirs(out, exist_ok=True)
    policy, rm = os.path.join(args.models, "policy"), os.path.join(args.models, "rm")
    cfg = build_config(
        PPOConfig,
        preset(
            "ppo",
            {
                "policy_path": policy,
                "reward_path": rm,
                "lr": 1e-3,
                "critic_lr": 1e-3,
                "rollout_batch_size": 8,
                "minibatch_size": 4,
                "score_norm": "normalize",
                "kl_coef": 0.05,
                "generation": {"max_new_tokens": 8},
                "adaptive_kl": True,
                "kl_target": 0.01,
                "kl_horizon": 100,
                "whiten_advantages": True,
                "advantage_clip": None,
                "export_dir": export_dir,
            },
        ),
        "algo",
    )
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=policy))
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=64, n_val=0, batch_size=8).connect(tok)
    strategy = cpu_strategy(args.strategy, micro_batch=8)
    callbacks = [Dump(out, policy), ResumeState()]  # ResumeState: as runner.build_trainer adds it to every job
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(ckpt_dir),
        enable_progress_bar=False,
        callbacks=callbacks,
        limit_val_batches=0,
    )
    trainer.fit(module, data, ckpt_path=resume)


if __name__ == "__main__":
    main()
