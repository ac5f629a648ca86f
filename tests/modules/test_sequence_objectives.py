"""GSPO, CISPO and GMPO: presets of CriticFreeModule (docs/algorithms.md §6.3) that select an objective
of core/objectives.py POLICY_LOSSES; they compose to their papers' values, train on the embedded task
through the one RL iteration, plan their memory, and refuse what they do not define."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rlhf.modules.configs import CriticFreeConfig, PPOConfig
from lit_rlhf.utils.config import ConfigError, build_config
from tests.helpers.presets import preset
from tests.modules.test_grpo_module import GOLD, Keep, data, fit, make

PAPERS = {
    "gspo": dict(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.0, minibatch_size=8),
    "cispo": dict(
        policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=0.28, kl_coef=0.0, loss_aggregation="token_mean"
    ),
    "gmpo": dict(policy_loss="gmpo", kl_coef=0.0, loss_aggregation="seq_mean_token_mean"),
}


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_presets_compose_to_the_papers_values(name):
    composed = preset(name)
    assert {k: composed[k] for k in PAPERS[name]} == pytest.approx(PAPERS[name])
    assert composed["_target_"] == "lit_rlhf.modules.critic_free.CriticFreeModule"
    if name == "gmpo":  # the paper's log-space range (e^-0.4, e^0.4) as ratio bounds
        assert composed["clip_eps_low"] == pytest.approx(1 - math.exp(-0.4), abs=1e-5)
        assert composed["clip_eps_high"] == pytest.approx(math.exp(0.4) - 1, abs=1e-5)
    assert composed["rollout_batch_size"] // composed["minibatch_size"] == 4  # the ratio (and its clip) act


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_each_preset_trains_on_the_embedded_task(name, saved_models, tokenizer):
    torch.manual_seed(0)
    m = make(saved_models, tokenizer, algo=name, reward_fn=GOLD, minibatch_size=8)  # 2 updates per rollout
    m.configure_model()
    before = {k: v.clone() for k, v in m.actor.state_dict().items()}
    keep = Keep()
    trainer = fit(m, data(tokenizer), max_steps=4, callbacks=[keep])
    assert m.iteration == 2 and m.kl_coef == 0.0  # no KL term (the reference only monitors the KL)
    assert any(not torch.equal(before[k], v) for k, v in m.actor.state_dict().items())
    for key in ("policy/loss", "policy/clipfrac", "policy/ratio_mean", "policy/approx_kl"):
        assert math.isfinite(float(trainer.callback_metrics[key])), key
    # the second minibatch of an iteration is off-policy: its ratio has moved from 1
    assert float(trainer.callback_metrics["policy/ratio_max"]) != 1.0


def test_what_an_objective_does_not_define_is_refused():
    base = dict(policy_path="p", reward_fn=GOLD)
    with pytest.raises(ConfigError, match="dual_clip: algo.policy_loss=gspo has no dual clip"):
        build_config(CriticFreeConfig, preset("gspo", {**base, "dual_clip": 3.0}), "algo")
    with pytest.raises(ConfigError, match="policy_loss: gmpo reads one advantage per response"):
        build_config(PPOConfig, preset("ppo", {**base, "policy_loss": "gmpo"}), "algo")
    with pytest.raises(ConfigError, match="clip_eps_high: must be >="):  # PPO's clip keeps clip-higher's order
        build_config(CriticFreeConfig, preset("grpo", {**base, "clip_eps_low": 0.3, "clip_eps_high": 0.2}), "algo")
    build_config(CriticFreeConfig, preset("cispo", base), "algo")  # CISPO's free weight bounds: 1.0 and 0.28
    build_config(PPOConfig, preset("ppo", {**base, "policy_loss": "cispo", "clip_eps_high": 0.28}), "algo")


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_presets_plan_their_memory(name):
    from lit_rlhf.launch.runner import memory_plan
    from tests.conftest import compose

    gold = "algo.reward_fn={_target_: lit_rlhf.data.synthetic.gold_reward_fn}"
    plan = memory_plan(compose([f"algo={name}", "model=llama7b", "strategy=deepspeed_stage_2", gold]))
    assert [r.name for r in plan.rows] == ["actor", "reference"]  # a callable reward; the KL monitor's reference
    assert plan.peak > plan.model_states > 0 and plan.activations > 0
