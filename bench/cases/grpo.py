"""GRPO: lit_rlhf's ``CriticFreeModule`` against TRL's ``GRPOTrainer``, in separate processes (``grpo_ours``,
``grpo_trl``) and in one process with their steps alternating (``grpo_paired``, :class:`Alternation`)."""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .alternation import Alternation
from .common import median_step, step_timer, trl_path

GRPO_G = 4  # responses per prompt in the GRPO cases: batch / G prompts per step
PAIRED_STEPS = 16  # timed step pairs of grpo_paired (no interpreter start per step: more steps are cheap)


def _grpo_ours(
    models: Path, s: dict, n: int, callbacks: list, reward: dict | None = None, algo: dict | None = None
) -> Any:
    """A Lightning ``Trainer`` and the ``fit`` arguments of lit_rlhf's GRPO for ``n`` iterations: ``batch``
    responses per step (batch / G prompts), ``new_tokens`` each at temperature 0.7, β 0.04 with the
    reference loaded, one update per rollout, the embedded gold reward as a Python callable (or the
    ``reward`` keys given: ``{"reward_path": …}``, ``{"reward_fn": …}``); ``algo``: more ``algo.*`` keys."""
    import lightning.pytorch as pl

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.presets import preset
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import CriticFreeConfig
    from lit_rlhf.modules.critic_free import CriticFreeModule
    from lit_rlhf.utils.config import build_config

    cfg = build_config(
        CriticFreeConfig,
        preset(
            "grpo",
            dict(
                policy_path=str(models / "policy"),
                **(reward or {"reward_fn": {"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}}),
                lr=1e-6,
                num_generations=GRPO_G,
                rollout_batch_size=s["batch"],
                kl_coef=0.04,
                export_dir=None,
                generation={
                    "max_new_tokens": s["new_tokens"],
                    "temperature": 0.7,
                    "top_p": 1.0,
                    "top_k": 0,
                    "repetition_penalty": 1.0,
                },
                **(algo or {}),
            ),
        ),
        "algo",
    )
    spec = CriticFreeModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = CriticFreeModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=s["batch"] * 50, n_val=0, batch_size=s["batch"] // GRPO_G).connect(tok)
    trainer = pl.Trainer(
        max_steps=n,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    return trainer, module, data


def _grpo_trl(models: Path, s: dict, n: int, callbacks: list) -> Any:
    """TRL's ``GRPOTrainer`` for ``n`` steps with the same G, prompts, new tokens, temperature, β 0.04
    (reference loaded), one update per generation, the same reward callable; fp32, no gradient
    checkpointing."""
    trl_path()
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lit_rlhf.data.synthetic import SyntheticTask, gold_reward_fn
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    ds = Dataset.from_dict(
        {"prompt": [r["prompt"] for r in SyntheticTask().prompts(s["batch"] // GRPO_G * n, "train")]}
    )
    gold = gold_reward_fn()

    def reward(prompts, completions, **kw):
        return gold(prompts, completions, [True] * len(completions))

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=s["batch"],
        num_generations=GRPO_G,
        max_completion_length=s["new_tokens"],
        temperature=0.7,
        top_p=1.0,
        beta=0.04,
        loss_type="grpo",
        max_steps=n,
        learning_rate=1e-6,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    return GRPOTrainer(
        model=str(models / "policy"),
        reward_funcs=reward,
        args=args,
        processing_class=tok,
        train_dataset=ds,
        callbacks=callbacks,
    )


def case_grpo_ours(models: Path, s: dict) -> dict:
    """lit_rlhf ``CriticFreeModule`` iterations through Lightning's Trainer (:func:`_grpo_ours`), timed per
    iteration, with the phase breakdown (rollout vs update) from the module's own perf metrics."""
    import lightning.pytorch as pl

    phases = []

    class Phases(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            st = outputs["stats"]
            phases.append((float(st["perf/rollout_s"]), float(st["perf/train_s"])))

    timer = step_timer()
    trainer, module, data = _grpo_ours(models, s, s["warmup"] + s["steps"], [timer, Phases()])
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, s["warmup"])
    rollout = statistics.median(p[0] for p in phases[s["warmup"] :])
    return {"step_s": t, "samples_per_s": s["batch"] / t, "rollout_s": rollout, "update_s": t - rollout}


def case_grpo_trl(models: Path, s: dict) -> dict:
    """TRL ``GRPOTrainer`` (:func:`_grpo_trl`), timed per step."""
    from transformers import TrainerCallback

    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    trainer = _grpo_trl(models, s, s["warmup"] + s["steps"], [Timer()])
    t_start = time.perf_counter()
    trainer.train()
    t = median_step([t_start] + times, s["warmup"])
    return {"step_s": t, "samples_per_s": s["batch"] / t}


def case_grpo_paired(models: Path, s: dict) -> dict:
    """lit_rlhf's and TRL's GRPO (:func:`_grpo_ours`, :func:`_grpo_trl`) in ONE process, their steps
    alternating (ours, TRL's, ours, …; :class:`Alternation`): the per-pair ratio TRL cycle / our
    cycle, its median and quartiles. Peak RSS and the phase breakdown come from the separate cases."""
    import lightning.pytorch as pl
    from transformers import TrainerCallback

    n = s["warmup"] + PAIRED_STEPS + 1  # the last cycle (into teardown) is not timed
    alt = Alternation("ours", "trl")

    class OurTurn(pl.Callback):
        def on_train_batch_start(self, *args):
            alt.step("ours")

    class TheirTurn(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            alt.step("trl")

    trainer, module, data = _grpo_ours(models, s, n, [OurTurn()])
    trl = _grpo_trl(models, s, n, [TheirTurn()])
    errors: list[BaseException] = []

    def fit_ours() -> None:
        try:
            trainer.fit(module, data)
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)
        finally:
            alt.finish("ours")

    thread = threading.Thread(target=fit_ours, name="lit_rlhf-grpo")
    thread.start()
    try:
        trl.train()
    finally:
        alt.finish("trl")
        thread.join()
    if errors:
        raise errors[0]
    pairs = alt.pairs(s["warmup"])
    ratios = sorted(theirs / ours for ours, theirs in pairs)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    ours_s, trl_s = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    return {
        "step_s": ours_s,
        "samples_per_s": s["batch"] / ours_s,
        "trl_step_s": trl_s,
        "ratio": statistics.median(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "pairs": len(pairs),
    }
