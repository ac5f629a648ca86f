"""REINFORCE++, REINFORCE++-baseline and ReMax: presets of CriticFreeModule (docs/algorithms.md §6.1, §6.2),
checked number by number against the papers' formulas (written out as loops in
tests/core/test_advantages.py) on the module's own rollouts, with β read from the KL controller."""

import statistics

import pytest
import torch

from lit_rlhf.core.types import Rollout
from lit_rlhf.modules.configs import CriticFreeConfig
from lit_rlhf.modules.critic_free import CriticFreeModule
from lit_rlhf.utils.config import ConfigError, build_config
from tests.core.test_advantages import naive_kl_shaped, naive_whiten
from tests.helpers.presets import preset
from tests.modules.test_grpo_module import GOLD, Keep, data, fit, make

# what defines each algorithm in its paper, checked against what its preset composes to (the modules
# below are built from the presets themselves: make(..., algo=<preset>))
REINFORCE_PP = dict(
    num_generations=1,
    advantage_baseline="none",
    scale_rewards=False,
    whiten_advantages=True,
    kl_placement="reward",
    kl_estimator="k1",
    loss_aggregation="token_mean",
)
REINFORCE_PP_BASELINE = dict(
    advantage_baseline="mean",
    scale_rewards=False,
    whiten_advantages=True,
    kl_placement="loss",
    kl_estimator="k2",
    loss_aggregation="token_mean",
)
REMAX = dict(
    num_generations=1,
    advantage_baseline="greedy",
    scale_rewards=False,
    whiten_advantages=False,
    kl_placement="reward",
    kl_estimator="k1",
    loss_aggregation="token_mean",
)


def lengths_of(r: Rollout) -> list[int]:
    return r.response_mask.sum(-1).tolist()


def k1(r: Rollout) -> list[list[float]]:
    return (r.logprobs.double() - r.ref_logprobs.double()).tolist()


def test_presets_compose_to_the_papers_recipes(tmp_path):
    """Each preset is values of the one CriticFreeConfig (the CriticFreeModule target, no new module), with its
    paper's estimator and the recipe its YAML cites; the prompt loader's batch is rollout / G."""
    from lit_rlhf.launch.runner import plan
    from lit_rlhf.utils.config import to_dict
    from tests.conftest import compose

    base = ["model=llama7b", "algo.reward_path=/rm"]
    for name, keys, recipe in [
        ("reinforce_pp", REINFORCE_PP, dict(lr=5e-7, kl_coef=0.01, minibatch_size=4, num_iterations=1)),
        (
            "reinforce_pp_baseline",
            REINFORCE_PP_BASELINE,
            dict(lr=5e-7, kl_coef=1e-5, num_generations=8, minibatch_size=None),
        ),
        (
            "remax",
            REMAX,
            dict(
                lr=1e-6,
                kl_coef=0.05,
                weight_decay=0.1,
                scheduler="cosine",
                min_lr_ratio=0.0,
                minibatch_size=None,
                num_iterations=1,
            ),
        ),
    ]:
        cfg = compose([f"algo={name}", *base], tmp_path)
        assert cfg.algo._target_ == "lit_rlhf.modules.critic_free.CriticFreeModule"
        p = plan(cfg)
        typed = to_dict(p.algo)
        assert {k: typed[k] for k in {**keys, **recipe}} == {**keys, **recipe}, name
        assert p.data.batch_size * p.algo.num_generations == p.algo.rollout_batch_size == 32
        assert [n for n, _, _ in CriticFreeModule.planned_models(p.algo)] == ["actor", "reference", "reward model"]
    # REINFORCE++ and ReMax are fused (one pass over one minibatch) only where the recipe has one step
    assert CriticFreeModule(plan(compose(["algo=remax", *base], tmp_path)).algo).fused_first_forward(32)
    assert not CriticFreeModule(plan(compose(["algo=reinforce_pp", *base], tmp_path)).algo).fused_first_forward(32)


def test_reinforce_pp_advantages_are_the_papers_with_the_controllers_beta(saved_models, tokenizer):
    """REINFORCE++ on the module's rollout: A_t = r − β Σ_{s≥t} k1_s, whitened over every token of the
    batch; β is the KL controller's (0.2, as after a rollback raised it), not algo.kl_coef (0.05); no
    KL term in the loss."""
    m = make(
        saved_models, tokenizer, "reinforce_pp", kl_coef=0.05, rollout_batch_size=8, minibatch_size=None, reward_fn=GOLD
    )
    m.kl_ctl.value = 0.2
    keep = Keep()
    trainer = fit(m, data(tokenizer, prompts=8), 2, callbacks=[keep])
    r = keep.outputs[-1]["rollout"]  # the second iteration: the policy has moved, the KL is not 0
    assert r.scores.shape == (8,) and r.baseline_scores is None
    lengths = lengths_of(r)
    expected = naive_whiten(naive_kl_shaped(r.scores.tolist(), [0.0] * 8, k1(r), lengths, 0.2), lengths)
    torch.testing.assert_close(r.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    unshaped = naive_whiten(naive_kl_shaped(r.scores.tolist(), [0.0] * 8, k1(r), lengths, 0.0), lengths)
    assert (r.advantages.double() - torch.tensor(unshaped, dtype=torch.float64)).abs().max() > 1e-4  # the KL term acts
    assert "policy/kl_loss" not in trainer.callback_metrics and "grpo/zero_std_groups" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["kl_ctl/beta"]) == pytest.approx(0.2)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalizes_the_batch(saved_models, tokenizer):
    """REINFORCE++-baseline: (r − mean of its prompt's 4 responses) on every token, whitened over the
    batch; its KL (k2) is in the loss, so the advantages carry none."""
    m = make(saved_models, tokenizer, "reinforce_pp_baseline", kl_coef=0.1, reward_fn=GOLD)
    keep = Keep()
    trainer = fit(m, data(tokenizer), 1, callbacks=[keep])
    r = keep.outputs[0]["rollout"]
    s = r.scores.tolist()
    means = [statistics.mean(s[i // 4 * 4 : i // 4 * 4 + 4]) for i in range(16)]
    lengths = lengths_of(r)
    expected = naive_whiten(naive_kl_shaped(s, means, k1(r), lengths, 0.0), lengths)
    torch.testing.assert_close(r.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(trainer.callback_metrics["policy/kl_loss"])


def greedy_gold_scores(saved_models, tokenizer, r: Rollout, max_new_tokens: int) -> list[float]:
    """The gold reward of the greedy responses of the starting policy, decoded by transformers'
    ``generate`` (independent of lit_rlhf's decoding loop)."""
    from lit_rlhf.data.synthetic import gold_reward_fn
    from lit_rlhf.models.builders import build_causal_lm
    from lit_rlhf.models.spec import ModelSpec
    from lit_rlhf.rollout.collect import decode_responses

    model = build_causal_lm(ModelSpec(name_or_path=saved_models[0]), tokenizer).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=r.prompt_ids,
            attention_mask=r.prompt_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    response = out[:, r.prompt_ids.shape[1] :]
    is_eos = response == tokenizer.eos_token_id
    ended = is_eos.any(-1)
    first_eos = torch.where(
        ended, is_eos.long().argmax(-1), torch.full_like(ended, response.shape[1] - 1, dtype=torch.long)
    )
    mask = (torch.arange(response.shape[1])[None] <= first_eos[:, None]).long()
    texts = decode_responses(tokenizer, response, mask, ended)
    return gold_reward_fn()(r.prompts_text, texts, ended.tolist())


def test_remax_baseline_is_the_greedy_responses_reward_and_is_not_trained_on(saved_models, tokenizer):
    """ReMax, first iteration: each row's baseline is the gold reward of transformers' greedy decoding
    of its prompt by the starting policy; the rollout holds only the sampled responses (4 prompts:
    4 rows); A_t = r − r_greedy − β Σ_{s≥t} k1_s with the controller's β, not normalized."""
    gen = {"max_new_tokens": 6, "repetition_penalty": 1.0}  # transformers penalizes left padding too
    m = make(saved_models, tokenizer, "remax", kl_coef=0.05, rollout_batch_size=4, reward_fn=GOLD, generation=gen)
    m.kl_ctl.value = 0.3
    keep = Keep()
    trainer = fit(m, data(tokenizer), 1, callbacks=[keep])
    r = keep.outputs[0]["rollout"]
    assert r.scores.shape == r.baseline_scores.shape == (4,) and r.response_ids.shape[0] == 4
    expected_baseline = greedy_gold_scores(saved_models, tokenizer, r, 6)
    assert r.baseline_scores.tolist() == pytest.approx(expected_baseline, abs=1e-6)
    assert float(trainer.callback_metrics["reward/greedy_mean"]) == pytest.approx(
        statistics.mean(expected_baseline), abs=1e-6
    )
    expected = naive_kl_shaped(r.scores.tolist(), expected_baseline, k1(r), lengths_of(r), 0.3)
    torch.testing.assert_close(r.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_remax_samples_the_same_responses_as_a_run_without_the_greedy_decode(saved_models, tokenizer):
    """Greedy decoding draws no random numbers: with the same seed ReMax's sampled responses are those
    of REINFORCE++ (no baseline), and one greedy decode per prompt is the only extra sampling."""
    import lit_rlhf.modules.critic_free as grpo_module

    calls = []
    real = grpo_module.generate_and_score

    def spy(policy, batch, tokenizer, gen, **kw):
        calls.append((batch["prompt_ids"].shape[0], gen.do_sample, kw.get("reference"), kw.get("policy_logprobs")))
        return real(policy, batch, tokenizer, gen, **kw)

    responses = {}
    for name in ("remax", "reinforce_pp"):
        torch.manual_seed(0)
        m = make(saved_models, tokenizer, name, rollout_batch_size=4, reward_fn=GOLD)
        keep = Keep()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grpo_module, "generate_and_score", spy)
            fit(m, data(tokenizer), 2, callbacks=[keep])
        responses[name] = [o["rollout"].response_ids for o in keep.outputs]
    assert calls == [(4, False, None, False)] * 2  # ReMax only: one greedy decode of the 4 prompts an iteration
    for a, b in zip(responses["remax"], responses["reinforce_pp"], strict=True):
        assert torch.equal(a, b)


def rollout_by_hand(scores, baseline, lengths, kl_per_token) -> Rollout:
    b, width = len(scores), max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return Rollout(
        prompt_ids=torch.ones(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, width, dtype=torch.long),
        response_mask=mask,
        ended=torch.ones(b, dtype=torch.bool),
        logprobs=torch.full((b, width), kl_per_token) * mask,
        ref_logprobs=torch.zeros(b, width),
        scores=torch.tensor(scores),
        baseline_scores=None if baseline is None else torch.tensor(baseline),
    )


def test_a_non_finite_reward_or_greedy_reward_leaves_the_score_out(saved_models, tokenizer):
    """Hand values (β = 0.5, k1 = 0.25 on every token): a NaN sampled reward takes its row out (all 0);
    a NaN greedy reward leaves its row only the KL term, −β·0.25·(tokens to go); finite rows r − b − KL."""
    m = make(saved_models, tokenizer, "remax", kl_coef=0.5, rollout_batch_size=4)
    r = rollout_by_hand([1.0, float("nan"), 2.0, 3.0], [0.5, 0.0, float("nan"), 1.0], [2, 2, 2, 1], 0.25)
    stats = m.compute_advantages(r)
    assert r.advantages.tolist() == [[0.25, 0.375], [0.0, 0.0], [-0.25, -0.125], [1.875, 0.0]]
    assert float(stats["reward/greedy_mean"]) == pytest.approx(0.5)  # the finite greedy rewards
    assert m.health.nonfinite_scores == 1


def test_kl_in_the_loss_leaves_the_advantage_the_groups_and_no_reference_means_no_kl_term(saved_models, tokenizer):
    """kl_placement=loss (GRPO): the reward carries no KL whatever β; REINFORCE++ without a reference
    (β = 0, monitor_kl=false): returns of the score alone, normalized."""
    m = make(saved_models, tokenizer, kl_coef=0.5, num_generations=2, rollout_batch_size=4)
    r = rollout_by_hand([1.0, 3.0, 2.0, 2.0], None, [2, 1, 2, 2], 0.25)  # groups [1, 3] and [2, 2]
    m.compute_advantages(r)
    d = 1 / (2**0.5 + 1e-4)
    torch.testing.assert_close(r.advantages, torch.tensor([[-d, -d], [d, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    m = make(saved_models, tokenizer, "reinforce_pp", kl_coef=0.0, monitor_kl=False, rollout_batch_size=4)
    r = rollout_by_hand([1.0, 3.0, 2.0, 2.0], None, [2, 1, 2, 2], 0.25)
    r.ref_logprobs = None
    m.compute_advantages(r)
    expected = naive_whiten([[1.0, 1.0], [3.0, 0.0], [2.0, 2.0], [2.0, 2.0]], [2, 1, 2, 2])  # each score on its tokens
    torch.testing.assert_close(r.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"num_generations": 1},
            r"algo.num_generations: GRPO compares responses within a group: needs >= 2, got 1 "
            r"\(with algo.advantage_baseline=mean",
        ),
        (
            {"num_generations": 1, "advantage_baseline": "greedy"},
            r"algo.scale_rewards: divides by the group's reward std",
        ),
        (
            {"num_generations": 1, "advantage_baseline": "none", "scale_rewards": False, "dynamic_sampling": True},
            r"algo.dynamic_sampling: drops groups whose rewards are all equal",
        ),
        ({"kl_estimator": "k1"}, r"algo.kl_estimator: k1 in the loss has zero expected gradient"),
        (
            {"advantage_baseline": "median"},
            r"algo.advantage_baseline: must be one of \['mean', 'leave_one_out', 'greedy', 'none'\]",
        ),
        ({"kl_placement": "advantage"}, r"algo.kl_placement: must be one of \['reward', 'loss'\]"),
    ],
)
def test_bad_values_name_the_keys(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(CriticFreeConfig, preset("grpo", reward_path="/rm", **values), "algo")
    build_config(CriticFreeConfig, preset("reinforce_pp", reward_path="/rm"), "algo")  # k1 in the reward is fine
    build_config(CriticFreeConfig, preset("remax", reward_path="/rm"), "algo")
