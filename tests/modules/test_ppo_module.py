"""PPOModule on tiny models: learning happens where it should and nowhere else."""

import math

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers.ppo import data, fit, make


def test_steps_change_actor_and_critic_and_nothing_frozen(saved_models, tokenizer):
    torch.manual_seed(0)
    m = make(saved_models, tokenizer, kl_coef=0.05)
    m.configure_model()
    actor0 = {k: v.clone() for k, v in m.actor.state_dict().items()}
    critic0 = {k: v.clone() for k, v in m.critic.state_dict().items()}
    ref0 = {k: v.clone() for k, v in m.frozen["reference"].state_dict().items()}
    rm0 = {k: v.clone() for k, v in m.frozen["reward"].state_dict().items()}
    trainer = fit(m, data(tokenizer), max_steps=4)  # 2 iterations x 2 minibatches
    assert trainer.global_step == 4 and m.iteration == 2
    for name, p in m.actor.named_parameters():
        assert not torch.equal(actor0[name], p.detach()), f"actor {name} did not change"
    for name, p in m.critic.named_parameters():
        assert not torch.equal(critic0[name], p.detach()), f"critic {name} did not change"
    assert all(torch.equal(ref0[k], v) for k, v in m.frozen["reference"].state_dict().items())
    assert all(torch.equal(rm0[k], v) for k, v in m.frozen["reward"].state_dict().items())
    assert not any(n.startswith("frozen") for n, _ in m.named_parameters())  # not in checkpoints
    # spent gradients are released after each step (not held through the next rollout's peak)
    assert all(p.grad is None for p in m.parameters())
    for k, v in trainer.callback_metrics.items():
        assert math.isfinite(float(v)), k
    for key in (
        "policy/loss",
        "policy/clipfrac",
        "policy/approx_kl",
        "policy/entropy",
        "critic/loss",
        "critic/explained_variance",
        "reward/normalized_mean",
        "kl_ctl/beta",
    ):
        assert key in trainer.callback_metrics


def test_max_steps_counts_optimizer_steps_exactly(saved_models, tokenizer):
    m = make(saved_models, tokenizer, minibatch_size=2)  # 8 rollouts / 2 = 4 updates per iteration
    trainer = fit(m, data(tokenizer), max_steps=6)
    assert trainer.global_step == 6  # stopped inside the 2nd iteration, not at 8
    assert m.iteration == 2


def test_critic_warmup_freezes_the_actor(saved_models, tokenizer):
    m = make(saved_models, tokenizer, critic_warmup_steps=1, weight_decay=0.1)  # decay must not leak in
    m.configure_model()
    actor0 = {k: v.clone() for k, v in m.actor.state_dict().items()}
    critic0 = {k: v.clone() for k, v in m.critic.state_dict().items()}
    trainer = fit(m, data(tokenizer), max_steps=2)  # exactly the warm-up iteration
    assert all(torch.equal(actor0[k], v) for k, v in m.actor.state_dict().items())
    assert any(not torch.equal(critic0[k], v) for k, v in m.critic.state_dict().items())
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    assert lrs[:2] == pytest.approx([1e-3, 1e-3])  # the actor's own schedule starts after warm-up
    assert lrs[2:] == pytest.approx([1e-3 * m.lr_factor(2, 2)] * 2)  # the critic's ran all along


def test_callable_reward_and_fresh_critic_head(saved_models, tokenizer):
    """With a callable reward there is no reward model to start the critic from: the critic is a
    separate copy of the POLICY's trunk with a new scalar head (docs/algorithms.md §2.8)."""
    from transformers import AutoModelForCausalLM

    from lit_rlhf.models.heads import ScalarHead

    torch.manual_seed(0)
    m = make(saved_models, tokenizer, reward_fn={"_target_": "lit_rlhf.data.synthetic.gold_reward_fn"})
    m.configure_model()
    assert "reward" not in m.frozen
    policy = AutoModelForCausalLM.from_pretrained(saved_models[0]).state_dict()
    trunk = m.critic.backbone.state_dict()
    assert trunk.keys() == policy.keys() and all(torch.equal(trunk[k], policy[k]) for k in policy)
    assert isinstance(m.critic.head, ScalarHead) and float(m.critic.head.proj.bias) == 0.0
    assert 0 < float(m.critic.head.proj.weight.std()) < 1.0  # fresh 1/sqrt(H+1) init, not a trained RM head
    actor_ptrs = {p.data_ptr() for p in m.actor.parameters()}
    assert not any(p.data_ptr() in actor_ptrs for p in m.critic.parameters())  # a copy, not shared
    head0 = m.critic.head.proj.weight.detach().clone()
    trainer = fit(m, data(tokenizer), max_steps=2)
    assert trainer.callback_metrics["reward/normalized_mean"] <= 1.0  # the gold reward is ≤ 1
    assert not torch.equal(m.critic.head.proj.weight, head0)  # the fresh head trains


def test_ptx_term_adds_its_weighted_gradient_to_the_actor(saved_models, tokenizer):
    """PPO-ptx: with ptx_coef c the actor's gradient is the PPO gradient + c × the LM loss's gradient
    on the ptx batch (computed separately), and the critic's is unchanged."""
    m = make(saved_models, tokenizer, ptx_coef=0.5, minibatch_size=8, fuse_first_forward=False)
    m.configure_model()
    dm = data(tokenizer, ptx_source="synthetic", ptx_batch_size=4)
    dm.setup("fit")
    batch, _, _ = next(iter(dm.train_dataloader()))  # a CombinedLoader: (batch, batch_idx, dataloader_idx)
    torch.manual_seed(0)
    rollout, _ = m.collect(batch["prompts"])
    m.compute_advantages(rollout)

    def grads(fn):
        m.zero_grad()
        fn().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    with_ptx = grads(lambda: m.minibatch_loss(rollout, m.policy_forward(rollout), batch["ptx"])[0])
    without = grads(lambda: m.minibatch_loss(rollout, m.policy_forward(rollout), None)[0])
    lm_only = grads(lambda: m.ptx_term(batch["ptx"])[0])
    assert lm_only and any(g.abs().sum() > 0 for g in lm_only.values())
    for name, g in with_ptx.items():
        expected = without[name] + 0.5 * lm_only[name] if name in lm_only else without[name]
        torch.testing.assert_close(g, expected, atol=1e-6, rtol=1e-5, msg=name)
    assert all(n.startswith("actor.") for n in lm_only)  # the critic gets nothing from the ptx term
    stats = m.minibatch_loss(rollout, m.policy_forward(rollout), batch["ptx"])[1]
    assert float(stats["ptx/loss"]) == pytest.approx(float(m.ptx_term(batch["ptx"])[0]), rel=1e-5)


def test_ptx_data_without_a_coefficient_is_reported(saved_models, tokenizer, caplog):
    import logging

    m = make(saved_models, tokenizer, ptx_coef=0.0)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.modules.rl"):
        trainer = fit(m, data(tokenizer, ptx_source="synthetic", ptx_batch_size=8), max_steps=1)
    assert "ptx_source=synthetic is set but algo.ptx_coef=0" in caplog.text
    assert "ptx/loss" not in trainer.callback_metrics


def test_perf_metrics_are_logged_with_design_names(saved_models, tokenizer):
    """docs/metrics.md perf/* names; tokens/s over samples/s is the iteration's mean response length."""
    outputs = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, out, batch, batch_idx):
            outputs.append(out)

    m = make(saved_models, tokenizer, minibatch_size=8)
    trainer = fit(m, data(tokenizer), max_steps=1, callbacks=[Keep()])
    cm = trainer.callback_metrics
    for key in ("perf/samples_per_s", "perf/tokens_per_s", "perf/rollout_s", "perf/train_s"):
        assert float(cm[key]) > 0, key
    mean_length = outputs[-1]["rollout"].response_mask.sum(-1).float().mean().item()
    assert float(cm["perf/tokens_per_s"]) / float(cm["perf/samples_per_s"]) == pytest.approx(mean_length, rel=1e-4)


def test_checkpoint_holds_rl_state_and_resumes(saved_models, tokenizer, tmp_path):
    m = make(saved_models, tokenizer, score_norm="normalize", adaptive_kl=True, kl_coef=0.1, kl_target=1.0)
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
    )
    trainer.fit(m, data(tokenizer))
    trainer.save_checkpoint(tmp_path / "ppo.ckpt")
    ckpt = torch.load(tmp_path / "ppo.ckpt", weights_only=False)
    state = ckpt["lit_rlhf_rl"]
    assert state["iteration"] == 2 and state["reward_moments"]["count"] == 16
    assert state["kl_ctl"]["value"] == pytest.approx(m.kl_ctl.value) and m.kl_ctl.value != 0.1
    assert all(k.startswith(("actor.", "critic.")) for k in ckpt["state_dict"])
    resumed = make(saved_models, tokenizer, score_norm="normalize", adaptive_kl=True, kl_coef=0.1, kl_target=1.0)
    t2 = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        enable_checkpointing=False,
    )
    t2.fit(resumed, data(tokenizer), ckpt_path=tmp_path / "ppo.ckpt")
    assert t2.global_step == 6 and resumed.iteration == 3 and resumed.reward_moments.count == 24


def test_export_actor(saved_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    m = make(saved_models, tokenizer, export_dir=str(tmp_path / "actor"))
    fit(m, data(tokenizer), max_steps=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    x = torch.tensor([[2, 5, 9]])
    torch.testing.assert_close(loaded(input_ids=x).logits, m.actor(input_ids=x).logits)


@pytest.mark.slow
@pytest.mark.integration
def test_ppo_max_raises_the_gold_reward(tmp_path, trained_sft):
    """SFT on the embedded task (the shared ``trained_sft``), then PPO-max as the tiny experiment
    configures it, with the gold reward as the reward: mean gold reward on held-out prompts rises
    by ≥ 0.5 σ of SFT's."""
    from lit_rlhf.launch.runner import build
    from tests.conftest import compose

    cfg = compose(
        [
            "experiment=ppo_max_synthetic_tiny",
            f"algo.policy_path={trained_sft[0]}",
            "algo.reward_path=null",
            "algo.reward_fn={_target_:lit_rlhf.data.synthetic.gold_reward_fn}",
            "data.prompt.n_val=128",
            "data.prompt.eval_batch_size=64",
            "trainer.accelerator=cpu",
            "trainer.max_steps=400",
            "logger=none",
            "callbacks=none",
            "trainer.enable_progress_bar=false",
            "trainer.check_val_every_n_epoch=100",
        ],
        tmp_path / "ppo",
    )
    _, dm, module = build(cfg)
    trainer = pl.Trainer(
        max_steps=400,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        check_val_every_n_epoch=100,
    )
    before = trainer.validate(module, dm, verbose=False)[0]
    trainer.fit(module, dm)
    after = trainer.validate(module, dm, verbose=False)[0]
    sft_sigma = 0.25  # std of the gold reward of SFT-distribution text (tests/data/test_synthetic.py)
    assert after["val/score_mean"] - before["val/score_mean"] >= 0.5 * sft_sigma, (before, after)
    assert after["val/kl"] < 10.0  # the KL penalty keeps the policy near the SFT model


def test_fused_first_forward_is_exact(saved_models, tokenizer):
    """1 epoch x 1 minibatch: taking log π_old and V_old from the first training forward gives the
    same update as the separate rollout passes (and the same logged statistics)."""
    results = []
    for fuse in (True, False):
        torch.manual_seed(0)
        m = make(
            saved_models, tokenizer, minibatch_size=8, fuse_first_forward=fuse, kl_coef=0.05, score_norm="normalize"
        )
        trainer = fit(m, data(tokenizer), max_steps=2)  # 2 iterations, one optimizer step each
        assert m.fused_first_forward(8) is fuse and trainer.global_step == 2
        results.append(
            (
                {k: v.detach().clone() for k, v in m.actor.state_dict().items()},
                {k: v.detach().clone() for k, v in m.critic.state_dict().items()},
                {k: float(v) for k, v in trainer.callback_metrics.items()},
            )
        )
    (a1, c1, s1), (a2, c2, s2) = results
    # the same math; the rollout-time passes run under inference mode, whose kernels may round the
    # last bit differently, and Adam's m/√v turns near-zero gradients into up-to-lr steps, so the
    # weights agree to 1e-5 (1% of one Adam step at lr 1e-3), the statistics to 1e-5
    for k in a1:
        torch.testing.assert_close(a1[k], a2[k], atol=1e-5, rtol=1e-5, msg=k)
    for k in c1:
        torch.testing.assert_close(c1[k], c2[k], atol=1e-5, rtol=1e-5, msg=k)
    for k in ("policy/loss", "critic/loss", "policy/approx_kl", "critic/explained_variance"):
        assert s1[k] == pytest.approx(s2[k], abs=1e-5), k


def test_fusion_is_off_with_dropout_or_several_updates(saved_models, tokenizer):
    m = make(saved_models, tokenizer, minibatch_size=8)
    m.configure_model()
    assert m.fused_first_forward(8) and not m.fused_first_forward(16)  # 2 minibatches
    assert not make(saved_models, tokenizer, minibatch_size=8, ppo_epochs=2).fused_first_forward(8)
    m.actor.config.attention_dropout = 0.1
    assert not m.fused_first_forward(8)


def test_rollout_runs_in_inference_mode_unless_parameters_are_sharded(saved_models, tokenizer, monkeypatch):
    """Generation and frozen scoring run under inference mode, yet the rollout's tensors can enter
    the training forward; strategies that gather sharded parameters inside forwards get no_grad."""
    from dataclasses import fields
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

    from lit_rlhf.runtime.strategies import RLHFFSDPStrategy  # (not set up: nothing to gather)

    m = make(saved_models, tokenizer, minibatch_size=8)
    m.configure_model()
    dm = data(tokenizer)
    dm.setup("fit")
    import lit_rlhf.rollout.collect as collect

    seen, real_sample = [], collect.sample
    monkeypatch.setattr(
        collect, "sample", lambda *a, **k: seen.append(torch.is_inference_mode_enabled()) or real_sample(*a, **k)
    )
    rollout, _ = m.collect(next(iter(dm.train_dataloader())))
    assert seen == [True]
    tensors = [getattr(rollout, f.name) for f in fields(rollout) if isinstance(getattr(rollout, f.name), torch.Tensor)]
    assert tensors and not any(t.is_inference() for t in tensors)
    fwd = m.policy_forward(rollout)  # token ids enter autograd (embedding saves them)
    (fwd.logprobs.sum() + fwd.values.sum()).backward()
    assert m.actor.get_input_embeddings().weight.grad is not None
    for strategy, inference in (
        (SingleDeviceStrategy("cpu"), True),
        (DDPStrategy(), True),
        (DeepSpeedStrategy(stage=2), True),
        (DeepSpeedStrategy(stage=3), False),
        (FSDPStrategy(), False),
        (RLHFFSDPStrategy(), False),
    ):
        m._trainer = SimpleNamespace(strategy=strategy)
        with m.rollout_grad_mode():
            assert torch.is_inference_mode_enabled() is inference and not torch.is_grad_enabled(), strategy


def test_critic_starts_as_a_trainable_copy_of_the_reward_model(saved_models, tokenizer):
    """docs/algorithms.md §2: the critic is initialized from the RM (trunk AND head), as a separate copy:
    its values at the last token are the RM's scores, and training it leaves the frozen RM alone."""
    from lit_rlhf.models.reward import load_reward_model

    m = make(saved_models, tokenizer)
    m.configure_model()
    rm = load_reward_model(saved_models[1]).eval()
    critic_sd, rm_sd = m.critic.state_dict(), rm.state_dict()
    assert critic_sd.keys() == rm_sd.keys()
    for k in rm_sd:
        assert torch.equal(critic_sd[k], rm_sd[k]), k
    ids, mask = torch.tensor([[2, 10, 11, 12, 3], [0, 2, 20, 21, 3]]), torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(m.critic.eval()(ids, mask)[:, -1], rm(ids, mask))
    frozen = m.frozen["reward"]
    assert all(a is not b and a.data_ptr() != b.data_ptr() for a, b in zip(m.critic.parameters(), frozen.parameters()))
    assert all(p.requires_grad for p in m.critic.parameters()) and not any(p.requires_grad for p in frozen.parameters())


def test_beta_zero_without_kl_monitoring_trains_without_a_reference(saved_models, tokenizer, caplog):
    """algo.kl_coef=0 algo.monitor_kl=false: no reference is built, the rollout has no reference
    log-probs, the rewards are the bare scores on the EOS token (no KL term), and a collapse
    rollback's raise of β says that it cannot act."""
    import logging

    m = make(saved_models, tokenizer, kl_coef=0.0, monitor_kl=False, minibatch_size=8)
    outputs = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, module, out, batch, batch_idx):
            outputs.append(out)

    fit(m, data(tokenizer), max_steps=1, callbacks=[Keep()])
    r = outputs[0]["rollout"]
    assert "reference" not in m.frozen and r.ref_logprobs is None
    last = r.response_mask.sum(1) - 1  # the EOS (or last) token of each response gets the whole score
    shaped = r.rewards.gather(1, last[:, None]).squeeze(1)
    elsewhere = torch.ones_like(r.rewards, dtype=torch.bool)
    elsewhere[torch.arange(len(last)), last] = False
    assert not r.rewards[elsewhere].any()  # nothing elsewhere: no −β·kl (exactly 0, whatever the sum order)
    assert torch.isfinite(shaped).all() and not torch.equal(shaped, torch.zeros_like(shaped))
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.modules.rl"):
        assert m.scale_kl_coef(2.0) == (0.0, 0.002)
    assert "holds no reference model" in caplog.text
    with_ref = make(saved_models, tokenizer, kl_coef=0.0)
    with_ref.configure_model()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.modules.rl"):
        with_ref.scale_kl_coef(2.0)
    assert "reference" in with_ref.frozen and "holds no reference model" not in caplog.text
