"""DPO: lit_rlhf's ``DPOModule`` against TRL's ``DPOTrainer``, with the live or the precomputed reference."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import median_step, step_timer, trl_path


def _dpo_steps(s: dict) -> int:
    """Optimizer steps of a DPO case: batches of shuffled pairs differ in length, so 3× the usual
    timed steps keep the median stable."""
    return s["warmup"] + 3 * s["steps"]


def case_dpo_ours(models: Path, s: dict, precompute: bool = False) -> dict:
    """lit_rlhf ``DPOModule`` steps through Lightning's Trainer on ``batch`` pairs per step (the
    synthetic test pairs, max length 128, no length grouping), timed per optimizer step; with
    ``precompute`` the reference log-probs are computed before the timed steps (as TRL does)."""
    import lightning.pytorch as pl

    from lit_rlhf.data.preference import PreferenceDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.presets import preset
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import DPOConfig
    from lit_rlhf.modules.dpo import DPOModule
    from lit_rlhf.utils.config import build_config

    cfg = build_config(
        DPOConfig,
        preset(
            "dpo",
            dict(
                policy_path=str(models / "policy"),
                lr=1e-6,
                warmup_steps=0,
                drift_prompts=0,
                precompute_ref_logprobs=precompute,
                ref_cache=tempfile.mktemp(suffix=".pt"),
            ),
        ),
        "algo",
    )
    spec = DPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = DPOModule(cfg, model=spec, tokenizer=tok)
    n = _dpo_steps(s)
    dm = PreferenceDataModule(
        source="synthetic",
        n_train=s["batch"] * n,
        n_val=1,
        n_test=1,
        batch_size=s["batch"],
        max_length=128,
        group_by_length=False,
    ).connect(tok)
    timer = step_timer()
    trainer = pl.Trainer(
        max_steps=n,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, dm)
    t = median_step(timer.times, max(0, s["warmup"] - 1))  # from the first step's end: no setup time
    return {"step_s": t, "pairs_per_s": s["batch"] / t}


def case_dpo_trl(models: Path, s: dict, precompute: bool = False) -> dict:
    """TRL ``DPOTrainer`` on the same pairs and batch (fp32, no gradient checkpointing), timed per step."""
    trl_path()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    n = _dpo_steps(s)
    from lit_rlhf.data.synthetic import SyntheticTask

    rows = SyntheticTask().preference_pairs(s["batch"] * n, "train")
    ds = Dataset.from_dict({k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")})
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    args = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=s["batch"],
        max_steps=n,
        beta=0.1,
        precompute_ref_log_probs=precompute,
        max_length=128,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        use_cpu=True,
        learning_rate=1e-6,
        disable_tqdm=True,
        dataloader_drop_last=True,
        bf16=False,
        gradient_checkpointing=False,
    )  # fp32 like ours (TRL defaults: bf16 + checkpointing)
    trainer = DPOTrainer(
        model=str(models / "policy"), args=args, processing_class=tok, train_dataset=ds, callbacks=[Timer()]
    )
    trainer.train()
    t = median_step(times, max(0, s["warmup"] - 1))
    return {"step_s": t, "pairs_per_s": s["batch"] / t}
