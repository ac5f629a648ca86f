"""Run a few GRPO iterations under DDP or (CPU) DeepSpeed ZeRO-2 with N processes; each rank writes
its final actor parameters and metrics to OUT/rank<r>.pt.

    python tests/helpers/grpo_multiproc.py --strategy ddp --devices 2 --models DIR --out DIR

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

from lit_rlhf.data.prompts import PromptDataModule  # noqa: E402
from lit_rlhf.models.builders import build_tokenizer  # noqa: E402
from lit_rlhf.models.spec import ModelSpec  # noqa: E402
from lit_rlhf.modules.configs import GRPOConfig  # noqa: E402
from lit_rlhf.modules.grpo import GRPOModule  # noqa: E402
from lit_rlhf.utils.config import build_config  # noqa: E402
from tests.helpers.cpu_strategies import cpu_strategy, multiproc_args, wrapper_name  # noqa: E402


def main() -> None:
    args = multiproc_args("folder with policy/ and rm/")
    torch.set_num_threads(1)
    policy, rm = os.path.join(args.models, "policy"), os.path.join(args.models, "rm")
    cfg = build_config(GRPOConfig, {"policy_path": policy, "reward_path": rm, "lr": 1e-3, "num_generations": 4,
                                    "rollout_batch_size": 8, "minibatch_size": 4, "num_iterations": 2,
                                    "generation": {"max_new_tokens": 6}}, "algo")  # fmt: skip
    spec = GRPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=policy))
    tok = build_tokenizer(spec)
    module = GRPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=64, n_val=0, batch_size=2).connect(tok)
    strategy = cpu_strategy(args.strategy, micro_batch=4)
    wrapper = []

    class Wrapper(pl.Callback):  # the strategy's wrapper during fit (teardown unwraps DDP)
        def on_train_start(self, trainer, module):
            wrapper.append(wrapper_name(trainer, module.actor))

    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         callbacks=[Wrapper()])  # fmt: skip
    trainer.fit(module, data)
    params = {k: v.detach().float().cpu().clone() for k, v in module.actor.state_dict().items()}
    torch.save({"params": params, "world_size": trainer.world_size, "global_step": trainer.global_step,
                "iteration": module.rl_iteration, "wrapper": wrapper[0]},
               os.path.join(args.out, f"rank{trainer.global_rank}.pt"))  # fmt: skip


if __name__ == "__main__":
    main()
