"""Train a tiny reward model for a few epochs under (CPU) DeepSpeed ZeRO-2 with N processes, a
ModelCheckpoint on ``val/accuracy`` (folders saved atomically, as the runner sets up) and
``export_dir`` set; rank zero writes OUT/result.pt with the best checkpoint's path and the live
(last) weights, for tests/test_distributed.py.

    python tests/helpers/rm_deepspeed_best.py --devices 2 --out DIR

Run as a script: Lightning's subprocess launcher re-executes it once per extra rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers importable when run as a script

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lit_rlhf.data.preference import PreferenceDataModule  # noqa: E402
from lit_rlhf.data.tokenizers import build_tokenizer  # noqa: E402
from lit_rlhf.models.spec import ModelSpec, TinyLlamaConfig  # noqa: E402
from lit_rlhf.modules.reward_model import RewardModelModule  # noqa: E402
from lit_rlhf.runtime.checkpoint_io import atomic_deepspeed_saves  # noqa: E402
from tests.helpers.deepspeed_cpu import CPUDeepSpeedStrategy  # noqa: E402


class Dump(pl.Callback):
    def __init__(self, out: str, ckpt: ModelCheckpoint) -> None:
        self.out, self.ckpt = out, ckpt

    def on_fit_end(self, trainer, module) -> None:  # runs before the module's on_fit_end (the export)
        if trainer.is_global_zero:
            live = {k: v.detach().float().cpu().clone() for k, v in module.reward_model.state_dict().items()}
            torch.save(
                {
                    "best": self.ckpt.best_model_path,
                    "scores": {str(k): float(v) for k, v in self.ckpt.best_k_models.items()},
                    "live": live,
                    "world_size": trainer.world_size,
                },
                os.path.join(self.out, "result.pt"),
            )


PARSER = argparse.ArgumentParser()
PARSER.add_argument("--devices", type=int, default=2)
PARSER.add_argument("--out", required=True)


def main() -> None:
    torch.set_num_threads(1)
    run(PARSER.parse_args())


def run(args) -> None:
    torch.manual_seed(0)
    spec = ModelSpec(
        tiny=TinyLlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        tokenizer="synthetic",
    )
    tok = build_tokenizer(spec)
    module = RewardModelModule(model=spec, tokenizer=tok, lr=3e-3, export_dir=os.path.join(args.out, "rm"))
    data = PreferenceDataModule(n_train=64, n_val=32, n_test=8, batch_size=8).connect(tok)
    # mode "min": the WORST epoch is "best", so the best checkpoint is not the last weights
    # (a "max" run would usually pick the last epoch and prove nothing); the test checks it
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val/accuracy", mode="min", save_top_k=1)
    strategy = CPUDeepSpeedStrategy(
        config={
            "zero_optimization": {"stage": 2},
            "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": 8,
        }
    )
    atomic_deepspeed_saves(strategy)  # as the runner does: folders written beside and swapped in
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ckpt, Dump(args.out, ckpt)],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
