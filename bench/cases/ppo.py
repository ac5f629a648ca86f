"""PPO: the naive floor of a step (its parts alone), lit_rlhf's ``ppo_max`` step against TRL's
``PPOTrainer``, and the peak memory of full fine-tuning against LoRA."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import build_models, median_step, peak_rss_mb, prompts, step_timer, timed, trl_path


def case_floor(models: Path, s: dict) -> dict:
    """Each essential part of a PPO step alone: generate, four no-grad scoring forwards, the actor and
    critic train forward/backward (+ optimizer step). Their sum is the naive floor."""
    import torch

    from lit_rlhf.data.collate import pad
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.models.builders import build_causal_lm, freeze
    from lit_rlhf.models.reward import load_reward_model
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.models.value import ValueModel
    from lit_rlhf.rollout.forward import response_logprobs, response_values
    from lit_rlhf.rollout.generate import GenerationConfig, sample

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
        r, m, _, _ = sample(actor, ids, mask, gen, tok.eos_token_id, tok.pad_token_id)
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
    return {
        "generate_s": t_gen,
        "score_forwards_s": t_score,
        "train_fwd_bwd_s": t_train,
        "floor_s": t_gen + t_score + t_train,
    }


def case_ppo_ours(models: Path, s: dict, engine: str = "hf") -> dict:
    """A lit_rlhf ``ppo_max`` iteration (1 epoch, 1 minibatch) through Lightning's Trainer, sampled by
    ``engine`` (hf: the decoding loop; vllm: the colocated vLLM engine, synced every iteration)."""
    import lightning.pytorch as pl

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.presets import preset
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config

    values = dict(
        policy_path=str(models / "policy"),
        reward_path=str(models / "rm"),
        export_dir=None,
        rollout_batch_size=s["batch"],
        minibatch_size=s["batch"],
        ppo_epochs=1,
        critic_warmup_steps=0,
        lr=1e-6,
        critic_lr=1e-6,
        generation={
            "max_new_tokens": s["new_tokens"],
            "temperature": 0.7,
            "top_p": 1.0,
            "top_k": 0,
            "repetition_penalty": 1.0,
            "engine": engine,
            "vllm": {"kv_cache_gib": 0.5},
        },
    )
    cfg = build_config(PPOConfig, preset("ppo_max", values), "algo")
    spec = PPOModule.resolve_model_spec(cfg, ModelSpec(name_or_path=str(models / "policy")))
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=s["batch"] * 50, n_val=0, batch_size=s["batch"]).connect(tok)
    timer = step_timer()
    n = s["warmup"] + s["steps"]
    trainer = pl.Trainer(
        max_steps=n,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[timer],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, s["warmup"])
    return {"step_s": t, "samples_per_s": s["batch"] / t, "fused_first_forward": module.fused_first_forward(s["batch"])}


def case_ppo_trl(models: Path, s: dict) -> dict:
    """TRL 1.12.0 ``trl.experimental.ppo.PPOTrainer``, same models and shapes, timed per update."""
    trl_path()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from lit_rlhf.data.tokenizers import build_tokenizer
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
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=s["batch"],
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=s["batch"] * n,
        response_length=s["new_tokens"],
        local_rollout_forward_batch_size=s["batch"],
        stop_token=None,
        report_to=[],
        num_sample_generations=0,
        save_strategy="no",
        logging_steps=10_000,
        use_cpu=True,
        temperature=0.7,
        learning_rate=1e-6,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
    )  # fp32 like ours (TRL defaults: bf16 + checkpointing)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=rm,
        value_model=vm,
        train_dataset=ds,
        callbacks=[Timer()],
    )
    t_start = time.perf_counter()
    torch.manual_seed(0)
    trainer.train()
    t = median_step([t_start] + times, s["warmup"])
    return {"step_s": t, "samples_per_s": s["batch"] / t}


MEM_SHAPE = dict(hidden=1024, layers=8, heads=16, inter=2816, batch=8, new_tokens=32, warmup=1, steps=2)


def case_ppo_memory(models: Path, s: dict, lora: bool) -> dict:
    """Peak memory of PPO-max steps, full fine-tuning vs LoRA (r=16, all linear layers), on a model
    large enough for model states to dominate (MEM_SHAPE: ~100M parameters, fp32; smoke: tiny).
    ``rss_mb`` is the process's peak; ``base_mb`` its RSS before any model was built."""
    import lightning.pytorch as pl

    from lit_rlhf.data.prompts import PromptDataModule
    from lit_rlhf.data.tokenizers import build_tokenizer
    from lit_rlhf.launch.presets import preset
    from lit_rlhf.models.spec import LoraSpec, ModelSpec
    from lit_rlhf.modules.configs import PPOConfig
    from lit_rlhf.modules.ppo import PPOModule
    from lit_rlhf.utils.config import build_config

    base_mb = peak_rss_mb()
    shape = s if s["hidden"] <= 32 else MEM_SHAPE  # smoke: the tiny shapes
    folder = models / f"mem_{shape['hidden']}"
    if not (folder / "policy").exists():
        build_models(folder, shape)
    cfg = build_config(
        PPOConfig,
        preset(
            "ppo",
            dict(
                policy_path=str(folder / "policy"),
                reward_path=str(folder / "rm"),
                export_dir=None,
                rollout_batch_size=shape["batch"],
                minibatch_size=shape["batch"],
                ppo_epochs=1,
                score_norm="normalize",
                kl_coef=0.05,
                lr=1e-5,
                critic_lr=1e-5,
                generation={"max_new_tokens": shape["new_tokens"], "top_p": 1.0, "top_k": 0},
            ),
        ),
        "algo",
    )
    spec = PPOModule.resolve_model_spec(
        cfg, ModelSpec(name_or_path=str(folder / "policy"), lora=LoraSpec(enabled=lora, r=16, alpha=32.0))
    )
    tok = build_tokenizer(spec)
    module = PPOModule(cfg, model=spec, tokenizer=tok)
    data = PromptDataModule(n_train=shape["batch"] * 10, n_val=0, batch_size=shape["batch"]).connect(tok)
    timer = step_timer()
    trainer = pl.Trainer(
        max_steps=shape["warmup"] + shape["steps"],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[timer],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    t_start = time.perf_counter()
    trainer.fit(module, data)
    t = median_step([t_start] + timer.times, shape["warmup"])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {
        "step_s": t,
        "samples_per_s": shape["batch"] / t,
        "base_mb": base_mb,
        "trainable": trainable,
        "params": sum(p.numel() for p in module.parameters()),  # actor + critic (+ adapters)
        "policy_params": sum(p.numel() for n, p in module.actor.named_parameters() if ".lora_" not in n),
    }
