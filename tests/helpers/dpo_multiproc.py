"""Run a few DPO steps under DDP or (CPU) DeepSpeed ZeRO-2 with N processes, then one validation;
each rank writes its final policy parameters and the logged metrics to OUT/rank<r>.pt.

    python tests/helpers/dpo_multiproc.py --strategy ddp --devices 2 --models DIR --out DIR \
        [--precompute] [--loss-type kto]

With ``--loss-type kto`` each rank also records, for every KTO reference point it computed, its own
KL rows' (sum, count) and the z_ref it used (which must be the mean over BOTH ranks' rows).

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

from lit_rlhf.callbacks import KLMonitor, ResponseLengthMonitor  # noqa: E402
from lit_rlhf.data.preference import PreferenceDataModule  # noqa: E402
from lit_rlhf.data.tokenizers import build_tokenizer  # noqa: E402
from lit_rlhf.launch.presets import preset  # noqa: E402
from lit_rlhf.models.spec import ModelSpec  # noqa: E402
from lit_rlhf.modules.configs import DPOConfig  # noqa: E402
from lit_rlhf.modules.dpo import DPOModule  # noqa: E402
from lit_rlhf.utils.config import build_config  # noqa: E402
from tests.helpers.cpu_strategies import cpu_strategy, multiproc_args, run_parser, wrapper_name  # noqa: E402

PARSER = run_parser(
    "folder with policy/", [("--precompute", {"action": "store_true"}), ("--loss-type", {"default": "sigmoid"})]
)


def main() -> None:
    torch.set_num_threads(1)
    for args in multiproc_args(PARSER):
        run(args)


def run(args) -> None:
    policy = os.path.join(args.models, "policy")
    cfg = build_config(
        DPOConfig,
        preset(
            "dpo",
            {
                "policy_path": policy,
                "lr": 1e-3,
                "warmup_steps": 0,
                "drift_prompts": 4,
                "precompute_ref_logprobs": args.precompute,
                "generation": {"max_new_tokens": 6},
                "loss_type": args.loss_type,
            },
        ),
        "algo",
    )
    spec = DPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=policy))
    tok = build_tokenizer(spec)
    module = DPOModule(cfg, model=spec, tokenizer=tok)
    data = PreferenceDataModule(n_train=64, n_val=16, n_test=8, batch_size=4, unpaired=args.loss_type == "kto").connect(
        tok
    )
    reference_points = []  # KTO: (this rank's sum, count, the z_ref used) per call
    import lit_rlhf.modules.dpo as dpo

    def recording(policy_kl, ref_kl, reduce=None):
        diff = (policy_kl - ref_kl).double()
        z = kto_reference_point(policy_kl, ref_kl, reduce)
        reference_points.append((float(diff.sum()), diff.numel(), float(z)))
        return z

    kto_reference_point, dpo.kto_reference_point = dpo.kto_reference_point, recording  # (restored at the end)
    strategy = cpu_strategy(args.strategy, micro_batch=4)
    wrapper = []

    class Wrapper(pl.Callback):  # the strategy's wrapper during fit (teardown unwraps it)
        def on_train_start(self, trainer, module):
            wrapper.append(wrapper_name(trainer, module.policy))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=4,
        logger=False,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=4,
        default_root_dir=args.out,
        gradient_clip_val=0.5 if args.strategy == "fsdp" else None,
        callbacks=[KLMonitor(), ResponseLengthMonitor(), Wrapper()],
    )
    try:
        trainer.fit(module, data)
    finally:
        dpo.kto_reference_point = kto_reference_point
    params = {k: v.detach().float().cpu().clone() for k, v in module.policy.state_dict().items()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save(
        {
            "params": params,
            "metrics": metrics,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "wrapper": wrapper[0],
            "reference_points": reference_points,
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
