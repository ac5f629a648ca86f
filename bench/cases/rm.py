"""Reward model: one lit_rlhf optimizer step on ``batch`` pairs against TRL's ``RewardTrainer``."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import median_step, timed, trl_path


def _pairs(n: int) -> list[dict]:
    from lit_rlhf.data.synthetic import SyntheticTask

    return SyntheticTask().preference_pairs(n, "test")


def case_rm_ours(models: Path, s: dict) -> dict:
    """One reward-model optimizer step on ``batch`` pairs (chosen + rejected in one forward)."""
    import torch

    from lit_rlhf.data.chat import get_template
    from lit_rlhf.data.collate import EncodedPreference, collate_preference, encode_pair
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.reward_model import RewardModelModule

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    module = RewardModelModule(model=spec, tokenizer=tok, lr=1e-5)
    module.configure_model()
    t = get_template("plain")
    batch = collate_preference(
        [
            EncodedPreference(
                encode_pair(tok, p["prompt"], p["chosen"], t, 128), encode_pair(tok, p["prompt"], p["rejected"], t, 128)
            )
            for p in _pairs(s["batch"])
        ],
        tok.pad_token_id,
    )
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)
    from lit_rlhf.core.losses import pairwise_rm_loss

    def step():
        c, r, _ = module._scores(batch)
        loss, _ = pairwise_rm_loss(c, r, batch["margin"])
        opt.zero_grad()
        loss.backward()
        opt.step()

    tm = timed(step, s["warmup"], s["steps"])
    return {"step_s": tm, "pairs_per_s": s["batch"] / tm}


def case_rm_trl(models: Path, s: dict) -> dict:
    """TRL ``RewardTrainer`` on the same pairs, timed per optimizer step."""
    trl_path()
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    model = AutoModelForSequenceClassification.from_pretrained(models / "trl_rm", num_labels=1)
    n = s["warmup"] + s["steps"]
    rows = _pairs(s["batch"]) * n
    ds = Dataset.from_dict(
        {
            "chosen": [r["prompt"] + " " + r["chosen"] for r in rows],
            "rejected": [r["prompt"] + " " + r["rejected"] for r in rows],
        }
    )
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    args = RewardConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=s["batch"],
        max_steps=n,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        use_cpu=True,
        learning_rate=1e-5,
        disable_tqdm=True,
        max_length=128,
        dataloader_drop_last=True,
        bf16=False,
        gradient_checkpointing=False,
    )  # fp32 like ours (TRL defaults: bf16 + checkpointing)
    trainer = RewardTrainer(model=model, args=args, processing_class=tok, train_dataset=ds, callbacks=[Timer()])
    t_start = time.perf_counter()
    trainer.train()
    t = median_step([t_start] + times, s["warmup"])
    return {"step_s": t, "pairs_per_s": s["batch"] / t}
