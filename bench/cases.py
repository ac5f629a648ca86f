"""The benchmark cases (bench/run.py runs each in its own process): PPO, RM, DPO and GRPO steps of
lit_rlhf and TRL (GRPO also both in one process, steps alternating: :class:`Alternation`), the
naive floor of a PPO step, generation. Each returns a dict of measurements."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_DIR = ROOT / "bench" / ".trl"
TRL_VERSION = "1.12.0"


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(hidden=32, layers=1, heads=2, inter=64, batch=4, new_tokens=8, warmup=1, steps=1)
    return dict(hidden=256, layers=4, heads=4, inter=512, batch=16, new_tokens=64, warmup=2, steps=6)


# --------------------------------------------------------------------------- setup
def build_models(out: Path, s: dict) -> None:
    """Random tiny models on disk: ours (policy, reward model) and TRL's (*ForSequenceClassification)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from lit_rlhf.data.synthetic import build_tokenizer
    from lit_rlhf.models.reward import RewardModel

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], intermediate_size=s["inter"], max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      num_labels=1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    rm = RewardModel(LlamaForCausalLM(cfg), "causal_lm", "last")
    rm.save_pretrained(str(out / "rm"))
    tok.save_pretrained(out / "rm")
    LlamaForSequenceClassification(cfg).save_pretrained(out / "trl_rm")
    (out / "params.json").write_text(json.dumps({"policy_params": sum(p.numel() for p in policy.parameters())}))


def prompts(tok, n: int) -> list[list[int]]:
    from lit_rlhf.data.synthetic import SyntheticTask

    return [tok(r["prompt"])["input_ids"] for r in SyntheticTask().prompts(n, "test")]


def timed(fn, warmup: int, steps: int) -> float:
    """Median seconds of ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        durations.append(time.perf_counter() - t0)
    return statistics.median(durations)


def median_step(stamps: list[float], warmup: int) -> float:
    """Median of the intervals between consecutive step-end timestamps, after ``warmup`` steps."""
    durations = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return statistics.median(durations)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --------------------------------------------------------------------------- cases
def case_floor(models: Path, s: dict) -> dict:
    """Each essential part of a PPO step alone: generate, four no-grad scoring forwards, the actor and
    critic train forward/backward (+ optimizer step). Their sum is the naive floor."""
    import torch

    from lit_rlhf.data.collate import pad
    from lit_rlhf.models.builders import build_causal_lm, build_tokenizer, freeze
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.models.value import ValueModel
    from lit_rlhf.rollout.generate import GenerationConfig, sample
    from lit_rlhf.rollout.score import response_logprobs, response_values

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    actor, ref = build_causal_lm(spec, tok), freeze(build_causal_lm(spec, tok))
    rm = freeze(load_reward_model(str(models / "rm")))
    critic = ValueModel.from_reward_model(load_reward_model(str(models / "rm")))
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=s["new_tokens"], temperature=0.7)
    state = {}

    def generate():
        torch.manual_seed(0)
        r, m, _ = sample(actor, ids, mask, gen, tok.eos_token_id, tok.pad_token_id)
        state["full"], state["mask"] = torch.cat([ids, r], 1), torch.cat([mask, m], 1)

    generate()
    width = ids.shape[1]

    @torch.no_grad()
    def score4():
        response_logprobs(actor, state["full"], state["mask"], width)
        response_logprobs(ref, state["full"], state["mask"], width)
        response_values(critic, state["full"], state["mask"], width)
        rm(state["full"], state["mask"])

    params = [p for p in list(actor.parameters()) + list(critic.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)

    def train():
        lp, _ = response_logprobs(actor, state["full"], state["mask"], width, with_entropy=True)
        v = response_values(critic, state["full"], state["mask"], width)
        loss = -lp.mean() + v.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    t_gen = timed(generate, s["warmup"], s["steps"])
    t_score = timed(score4, s["warmup"], s["steps"])
    t_train = timed(train, s["warmup"], s["steps"])
    return {"generate_s": t_gen, "score_forwards_s": t_score, "train_fwd_bwd_s": t_train,
            "floor_s": t_gen + t_score + t_train}  # fmt: skip


def case_generate_bare(models: Path, s: dict) -> dict:
    """Bare ``model.generate`` with the KV cache (the reference for generation speed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_rlhf.data.collate import pad
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    model = AutoModelForCausalLM.from_pretrained(models / "policy").eval()
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")

    @torch.no_grad()
    def go():
        torch.manual_seed(0)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=s["new_tokens"], min_new_tokens=s["new_tokens"],
                       do_sample=True, temperature=0.7, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id, use_cache=True)  # fmt: skip

    t = timed(go, s["warmup"], s["steps"])
    return {"step_s": t, "tokens_per_s": s["batch"] * s["new_tokens"] / t}


def case_generate_ours(models: Path, s: dict) -> dict:
    import torch

    from lit_rlhf.data.collate import pad
    from lit_rlhf.models.builders import build_causal_lm, build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.generate import GenerationConfig, sample

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    model = build_causal_lm(spec, tok)
    ids, mask = pad(prompts(tok, s["batch"]), tok.pad_token_id, "left")
    gen = GenerationConfig(max_new_tokens=s["new_tokens"], temperature=0.7)
    tokens = []

    def go():
        torch.manual_seed(0)
        _, m, _ = sample(model, ids, mask, gen, tok.eos_token_id, tok.pad_token_id)
        tokens.append(int(m.sum()))

    t = timed(go, s["warmup"], s["steps"])
    return {"step_s": t, "tokens_per_s": s["batch"] * s["new_tokens"] / t, "response_tokens_mean": statistics.mean(tokens)}


def _step_timer():
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter())

    return StepTimer()


def case_ppo_ours(models: Path, s: dict) -> dict:
    """A lit_rlhf ``ppo_max`` iteration (1 epoch, 1 minibatch) through Lightning's Trainer."""
    import lightning.pytorch as pl
    import yaml

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config

    values = {}
    for name in ("ppo", "ppo_max"):
        values.update({k: v for k, v in yaml.safe_load((ROOT / "conf" / "algo" / f"{name}.yaml").read_text()).items()
                       if not k.startswith("_") and k != "defaults"})  # fmt: skip
    values.update(policy_path=str(models / "policy"), reward_path=str(models / "rm"), export_dir=None,
                  rollout_batch_size=s["batch"], minibatch_size=s["batch"], ppo_epochs=1, critic_warmup_steps=0, lr=1e-6,
                  critic_lr=1e-6,
                  generation={"max_new_tokens": s["new_tokens"], "temperature": 0.7, "top_p": 1.0, "top_k": 0,
                              "repetition_penalty": 1.0})  # fmt: skip
    cfg = build_config(PPOConfig, values, "algo")
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=s["batch"] * 50, n_val=0, batch_size=s["batch"]).connect(tok)
    timer = _step_timer()
    n = s["warmup"] + s["steps"]
    trainer = pl.Trainer(max_steps=n, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[timer], limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, s["warmup"])
    return {"step_s": t, "samples_per_s": s["batch"] / t, "fused_first_forward": module.fused_first_forward(s["batch"])}


MEM_SHAPE = dict(hidden=1024, layers=8, heads=16, inter=2816, batch=8, new_tokens=32, warmup=1, steps=2)


def case_ppo_memory(models: Path, s: dict, lora: bool) -> dict:
    """Peak memory of PPO-max steps, full fine-tuning vs LoRA (r=16, all linear layers), on a model
    large enough for model states to dominate (MEM_SHAPE: ~100M parameters, fp32; smoke: tiny).
    ``rss_mb`` is the process's peak; ``base_mb`` its RSS before any model was built."""
    import lightning.pytorch as pl

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import LoraSpec, ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config

    base_mb = peak_rss_mb()
    shape = s if s["hidden"] <= 32 else MEM_SHAPE  # smoke: the tiny shapes
    folder = models / f"mem_{shape['hidden']}"
    if not (folder / "policy").exists():
        build_models(folder, shape)
    cfg = build_config(PPOConfig, dict(policy_path=str(folder / "policy"), reward_path=str(folder / "rm"), export_dir=None,
                                       rollout_batch_size=shape["batch"], minibatch_size=shape["batch"], ppo_epochs=1,
                                       score_norm="normalize", kl_coef=0.05, lr=1e-5, critic_lr=1e-5,
                                       generation={"max_new_tokens": shape["new_tokens"], "top_p": 1.0, "top_k": 0}),
                       "algo")  # fmt: skip
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(folder / "policy"),
                                                       lora=LoraSpec(enabled=lora, r=16, alpha=32.0)))  # fmt: skip
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=shape["batch"] * 10, n_val=0, batch_size=shape["batch"]).connect(tok)
    timer = _step_timer()
    trainer = pl.Trainer(max_steps=shape["warmup"] + shape["steps"], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[timer], limit_val_batches=0,
                         num_sanity_val_steps=0)  # fmt: skip
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, shape["warmup"])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"step_s": t, "samples_per_s": shape["batch"] / t, "base_mb": base_mb, "trainable": trainable,
            "params": sum(p.numel() for p in module.parameters()),  # actor + critic (+ adapters)
            "policy_params": sum(p.numel() for n, p in module.actor.named_parameters() if ".lora_" not in n)}


def _trl_path() -> None:
    if not (TRL_DIR / "trl").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TRL_DIR),
                        f"trl=={TRL_VERSION}"], check=True)  # fmt: skip
    sys.path.insert(0, str(TRL_DIR))


def case_ppo_trl(models: Path, s: dict) -> dict:
    """TRL 1.12.0 ``trl.experimental.ppo.PPOTrainer``, same models and shapes, timed per update."""
    _trl_path()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(models / "policy")
    ref = AutoModelForCausalLM.from_pretrained(models / "policy")
    rm = AutoModelForSequenceClassification.from_pretrained(models / "trl_rm", num_labels=1)
    vm = AutoModelForSequenceClassification.from_pretrained(models / "trl_rm", num_labels=1)
    ds = Dataset.from_dict({"input_ids": prompts(tok, s["batch"] * 4)})
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    n = s["warmup"] + s["steps"]
    args = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"], num_mini_batches=1,
                     num_ppo_epochs=1, total_episodes=s["batch"] * n, response_length=s["new_tokens"],
                     local_rollout_forward_batch_size=s["batch"], stop_token=None, report_to=[],
                     num_sample_generations=0, save_strategy="no", logging_steps=10_000, use_cpu=True,
                     temperature=0.7, learning_rate=1e-6, disable_tqdm=True,
                     bf16=False, gradient_checkpointing=False)  # fp32 like ours (TRL defaults: bf16 + checkpointing)  # fmt: skip
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=rm,
                         value_model=vm, train_dataset=ds, callbacks=[Timer()])  # fmt: skip
    t_start = time.perf_counter()
    torch.manual_seed(0)
    trainer.train()
    t = median_step([t_start] + times, s["warmup"])
    return {"step_s": t, "samples_per_s": s["batch"] / t}


def _pairs(n: int) -> list[dict]:
    from lit_rlhf.data.synthetic import SyntheticTask

    return SyntheticTask().preference_pairs(n, "test")


def case_rm_ours(models: Path, s: dict) -> dict:
    """One reward-model optimizer step on ``batch`` pairs (chosen + rejected in one forward)."""
    import torch

    from lit_rlhf.data.collate import EncodedPreference, collate_preference, encode_pair
    from lit_rlhf.data.templates import get_template
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.reward_model import RewardModelModule

    spec = ModelSpec(name_or_path=str(models / "policy"))
    tok = build_tokenizer(spec)
    module = RewardModelModule(model=spec, tokenizer=tok, lr=1e-5)
    module.configure_model()
    t = get_template("plain")
    batch = collate_preference([EncodedPreference(encode_pair(tok, p["prompt"], p["chosen"], t, 128),
                                                  encode_pair(tok, p["prompt"], p["rejected"], t, 128))
                                for p in _pairs(s["batch"])], tok.pad_token_id)  # fmt: skip
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
    _trl_path()
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    model = AutoModelForSequenceClassification.from_pretrained(models / "trl_rm", num_labels=1)
    n = s["warmup"] + s["steps"]
    rows = _pairs(s["batch"]) * n
    ds = Dataset.from_dict({"chosen": [r["prompt"] + " " + r["chosen"] for r in rows],
                            "rejected": [r["prompt"] + " " + r["rejected"] for r in rows]})  # fmt: skip
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    args = RewardConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"], max_steps=n,
                        report_to=[], save_strategy="no", logging_steps=10_000, use_cpu=True, learning_rate=1e-5,
                        disable_tqdm=True, max_length=128, dataloader_drop_last=True,
                        bf16=False, gradient_checkpointing=False)  # fp32 like ours (TRL defaults: bf16 + checkpointing)  # fmt: skip
    trainer = RewardTrainer(model=model, args=args, processing_class=tok, train_dataset=ds, callbacks=[Timer()])
    t_start = time.perf_counter()
    trainer.train()
    t = median_step([t_start] + times, s["warmup"])
    return {"step_s": t, "pairs_per_s": s["batch"] / t}


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
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import DPOConfig
    from lit_rlhf.modules.dpo import DPOModule
    from lit_rlhf.utils.config import build_config

    cfg = build_config(DPOConfig, dict(policy_path=str(models / "policy"), lr=1e-6, warmup_steps=0, drift_prompts=0,
                                       precompute_ref_logprobs=precompute, ref_cache=tempfile.mktemp(suffix=".pt")),
                       "algo")  # fmt: skip
    spec = DPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = DPOModule(cfg, model=spec, tokenizer=tok)
    n = _dpo_steps(s)
    dm = PreferenceDataModule(source="synthetic", n_train=s["batch"] * n, n_val=1, n_test=1, batch_size=s["batch"],
                              max_length=128, group_by_length=False).connect(tok)  # fmt: skip
    timer = _step_timer()
    trainer = pl.Trainer(max_steps=n, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                         enable_progress_bar=False, callbacks=[timer], num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, dm)
    t = median_step(timer.times, max(0, s["warmup"] - 1))  # from the first step's end: no setup time
    return {"step_s": t, "pairs_per_s": s["batch"] / t}


def case_dpo_trl(models: Path, s: dict, precompute: bool = False) -> dict:
    """TRL ``DPOTrainer`` on the same pairs and batch (fp32, no gradient checkpointing), timed per step."""
    _trl_path()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lit_rlhf.models.builders import build_tokenizer
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

    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"], max_steps=n, beta=0.1,
                     precompute_ref_log_probs=precompute, max_length=128, report_to=[], save_strategy="no",
                     logging_steps=10_000, use_cpu=True, learning_rate=1e-6, disable_tqdm=True, dataloader_drop_last=True,
                     bf16=False, gradient_checkpointing=False)  # fp32 like ours (TRL defaults: bf16 + checkpointing)  # fmt: skip
    trainer = DPOTrainer(model=str(models / "policy"), args=args, processing_class=tok, train_dataset=ds,
                         callbacks=[Timer()])  # fmt: skip
    trainer.train()
    t = median_step(times, max(0, s["warmup"] - 1))
    return {"step_s": t, "pairs_per_s": s["batch"] / t}


GRPO_G = 4  # responses per prompt in the GRPO cases: batch / G prompts per step
PAIRED_STEPS = 16  # timed step pairs of grpo_paired (no interpreter start per step: more steps are cheap)


def _grpo_ours(models: Path, s: dict, n: int, callbacks: list) -> Any:
    """A Lightning ``Trainer`` and the ``fit`` arguments of lit_rlhf's GRPO for ``n`` iterations: ``batch``
    responses per step (batch / G prompts), ``new_tokens`` each at temperature 0.7, β 0.04 with the
    reference loaded, one update per rollout, the embedded gold reward as a Python callable."""
    import lightning.pytorch as pl

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import GRPOConfig
    from lit_rlhf.modules.grpo import GRPOModule
    from lit_rlhf.utils.config import build_config

    cfg = build_config(GRPOConfig, dict(
        policy_path=str(models / "policy"), reward_fn={"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"}, lr=1e-6,
        num_generations=GRPO_G, rollout_batch_size=s["batch"], kl_coef=0.04, export_dir=None,
        generation={"max_new_tokens": s["new_tokens"], "temperature": 0.7, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
    ), "algo")  # fmt: skip
    spec = GRPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = GRPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=s["batch"] * 50, n_val=0, batch_size=s["batch"] // GRPO_G).connect(tok)
    trainer = pl.Trainer(max_steps=n, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                         enable_progress_bar=False, callbacks=callbacks, num_sanity_val_steps=0)  # fmt: skip
    return trainer, module, data


def _grpo_trl(models: Path, s: dict, n: int, callbacks: list) -> Any:
    """TRL's ``GRPOTrainer`` for ``n`` steps with the same G, prompts, new tokens, temperature, β 0.04
    (reference loaded), one update per generation, the same reward callable; fp32, no gradient
    checkpointing."""
    _trl_path()
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lit_rlhf.data.synthetic import SyntheticTask, gold_reward_fn
    from lit_rlhf.models.builders import build_tokenizer
    from lit_rlhf.models.spec import ModelSpec

    tok = build_tokenizer(ModelSpec(name_or_path=str(models / "policy")))
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in SyntheticTask().prompts(s["batch"] // GRPO_G * n, "train")]})
    gold = gold_reward_fn()

    def reward(prompts, completions, **kw):
        return gold(prompts, completions, [True] * len(completions))

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"], num_generations=GRPO_G,
                      max_completion_length=s["new_tokens"], temperature=0.7, top_p=1.0, beta=0.04, loss_type="grpo",
                      max_steps=n, learning_rate=1e-6, report_to=[], save_strategy="no", logging_steps=10_000,
                      use_cpu=True, disable_tqdm=True, bf16=False, gradient_checkpointing=False)  # fmt: skip
    return GRPOTrainer(model=str(models / "policy"), reward_funcs=reward, args=args, processing_class=tok,
                       train_dataset=ds, callbacks=callbacks)  # fmt: skip


def case_grpo_ours(models: Path, s: dict) -> dict:
    """lit_rlhf ``GRPOModule`` iterations through Lightning's Trainer (:func:`_grpo_ours`), timed per
    iteration, with the phase breakdown (rollout vs update) from the module's own perf metrics."""
    import lightning.pytorch as pl

    phases = []

    class Phases(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            st = outputs["stats"]
            phases.append((float(st["perf/rollout_s"]), float(st["perf/train_s"])))

    timer = _step_timer()
    trainer, module, data = _grpo_ours(models, s, s["warmup"] + s["steps"], [timer, Phases()])
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, s["warmup"])
    rollout = statistics.median(p[0] for p in phases[s["warmup"]:])
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


class Alternation:
    """Two training loops of one process taking turns, one step each: ``step(side)`` at the start
    of each of ``side``'s steps hands the turn to the other loop and waits for it back (the first
    call waits until both loops have set up), so only one loop computes at any time, and each
    loop's cycle (its step and the loop's own overhead up to its next step) is timed alone.
    ``finish(side)`` when a loop ends: the other then runs on without waiting. Adjacent cycles
    of the two loops, a second or so apart, share the machine's state: on a VM whose speed drifts
    over seconds their ratio is a much steadier measurement than runs minutes apart."""

    def __init__(self, first: str, second: str, timeout: float = 900.0) -> None:
        self.sides, self.turn, self.timeout = (first, second), first, timeout
        self.cond = threading.Condition()
        self.ready: set[str] = set()
        self.done: set[str] = set()
        self.holder: str | None = None
        self.started = 0.0
        self.cycles: dict[str, list[float]] = {first: [], second: []}

    def _other(self, side: str) -> str:
        return self.sides[1] if side == self.sides[0] else self.sides[0]

    def _release(self, side: str, now: float, record: bool) -> None:
        if self.holder == side:
            if record:
                self.cycles[side].append(now - self.started)
            self.holder, self.turn = None, self._other(side)

    def step(self, side: str) -> None:
        now = time.perf_counter()
        other = self._other(side)
        with self.cond:
            self._release(side, now, record=True)
            self.ready.add(side)
            self.cond.notify_all()
            mine = lambda: other in self.done or (len(self.ready) == 2 and self.turn == side)  # noqa: E731
            if not self.cond.wait_for(mine, self.timeout):
                raise TimeoutError(f"{side}: the other loop ({other}) kept the turn for {self.timeout:.0f} s")
            self.holder, self.started = side, time.perf_counter()

    def finish(self, side: str) -> None:
        with self.cond:
            self._release(side, time.perf_counter(), record=False)  # the last cycle holds the loop's teardown
            self.done.add(side)
            self.turn = self._other(side)
            self.cond.notify_all()

    def pairs(self, warmup: int) -> list[tuple[float, float]]:
        """(first's cycle, second's cycle) of each round after ``warmup``; first's ran just before."""
        a, b = self.cycles[self.sides[0]], self.cycles[self.sides[1]]
        return list(zip(a, b))[warmup:]


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
    return {"step_s": ours_s, "samples_per_s": s["batch"] / ours_s, "trl_step_s": trl_s,
            "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2], "pairs": len(pairs)}  # fmt: skip


CASES = {
    "generate_bare": case_generate_bare,
    "generate_ours": case_generate_ours,
    "floor": case_floor,
    "ppo_ours": case_ppo_ours,
    "ppo_trl": case_ppo_trl,
    "rm_ours": case_rm_ours,
    "rm_trl": case_rm_trl,
    "dpo_ours": case_dpo_ours,
    "dpo_trl": case_dpo_trl,
    "dpo_ours_precomputed": lambda models, s: case_dpo_ours(models, s, precompute=True),
    "dpo_trl_precomputed": lambda models, s: case_dpo_trl(models, s, precompute=True),
    "grpo_ours": case_grpo_ours,
    "grpo_trl": case_grpo_trl,
    "grpo_paired": case_grpo_paired,
    "ppomem_full": lambda models, s: case_ppo_memory(models, s, lora=False),
    "ppomem_lora": lambda models, s: case_ppo_memory(models, s, lora=True),
}
TRL_CASES = {"ppo_trl", "rm_trl", "dpo_trl", "dpo_trl_precomputed", "grpo_trl", "grpo_paired"}
