"""CollapseAlarm driven by synthetic metric streams: each signal, patience, and each action."""

import logging
import types

import pytest
import torch

from lit_rlhf.callbacks.collapse import KL, LENGTH, PPL, TAIL, CollapseAlarm, CollapseDetector

HEALTHY = {KL: 1.0, LENGTH: 10.0, PPL: 6.0, TAIL: 1.0}


def stream(detector, values):
    """Feed metric dicts; return the index of each trigger and its reasons."""
    out = []
    for i, m in enumerate(values):
        reasons = detector.observe(m)
        if reasons:
            out.append((i, reasons))
    return out


def baseline(n=5, jitter=True):
    # small natural variation around the healthy values
    return [{KL: 1.0, LENGTH: 10.0 + (0.5 if jitter and i % 2 else 0.0), PPL: 6.0, TAIL: 1.0} for i in range(n)]


def test_healthy_stream_never_triggers():
    d = CollapseDetector()
    assert stream(d, baseline(5) + [dict(HEALTHY) for _ in range(20)]) == []


def test_kl_bound_triggers_after_patience():
    d = CollapseDetector(kl_max=5.0, patience=2, min_signals=1)
    trig = stream(d, baseline(5) + [dict(HEALTHY, **{KL: 6.0})] * 3)
    assert [i for i, _ in trig] == [6]  # second alarming observation in a row; streak then restarts
    assert trig[0][1] == ["KL 6 > bound 5"]


def test_isolated_spike_is_not_a_trigger():
    d = CollapseDetector(kl_max=5.0, patience=2, min_signals=1)
    seq = baseline(5) + [dict(HEALTHY, **{KL: 9.0}), dict(HEALTHY), dict(HEALTHY, **{KL: 9.0}), dict(HEALTHY)]
    assert stream(d, seq) == []


def test_length_drift_in_sigmas_of_the_baseline():
    d = CollapseDetector(length_sigmas=4.0, min_length_sigma=1.0, patience=1, min_signals=1)
    # baseline lengths 10, 10.5, 10, 10.5, 10: mean 10.2, pstdev 0.245 -> floor 1.0 -> bound 4.0
    assert stream(d, baseline(5) + [dict(HEALTHY, **{LENGTH: 14.1})]) == []
    trig = stream(
        CollapseDetector(length_sigmas=4.0, patience=1, min_signals=1), baseline(5) + [dict(HEALTHY, **{LENGTH: 14.3})]
    )
    assert len(trig) == 1 and "response length 14.3 drifted" in trig[0][1][0]


def test_perplexity_fall():
    trig = stream(
        CollapseDetector(ppl_drop=0.5, patience=1, min_signals=1), baseline(5) + [dict(HEALTHY, **{PPL: 2.9})]
    )
    assert len(trig) == 1 and trig[0][1][0].startswith("perplexity 2.9 fell below 0.5 x baseline 6")
    assert (
        stream(CollapseDetector(ppl_drop=0.5, patience=1, min_signals=1), baseline(5) + [dict(HEALTHY, **{PPL: 3.1})])
        == []
    )


def test_reward_tail_growth():
    trig = stream(
        CollapseDetector(tail_factor=4.0, patience=1, min_signals=1), baseline(5) + [dict(HEALTHY, **{TAIL: 4.5})]
    )
    assert len(trig) == 1 and "reward tail ratio 4.5 > 4 x baseline 1" in trig[0][1][0]


def test_relative_signals_wait_for_their_baseline():
    d = CollapseDetector(baseline_steps=5, patience=1, min_signals=1)
    # a wild length during the baseline phase is part of the baseline, not an alarm
    assert stream(d, [dict(HEALTHY, **{LENGTH: 50.0})] + baseline(4)) == []


def test_by_default_one_signal_alone_is_normal_rl_and_the_triad_is_collapse():
    """min_signals=2: perplexity halving alone (a policy sharpening on its reward, like the demo's
    healthy PPO-max run) is no alarm; perplexity falling while KL and length climb is."""
    sharpening = [dict(HEALTHY, **{PPL: 6.0 - 0.4 * i}) for i in range(12)]  # down to 1.6
    assert stream(CollapseDetector(), baseline(5) + sharpening) == []
    collapsing = [{KL: 30.0 + i, LENGTH: 24.0, PPL: 1.1, TAIL: 1.0} for i in range(3)]
    trig = stream(CollapseDetector(), baseline(5) + collapsing)
    assert [i for i, _ in trig] == [6] and len(trig[0][1]) == 3
    two = [dict(HEALTHY, **{KL: 25.0, PPL: 2.0})] * 2  # any two signals
    assert [i for i, _ in stream(CollapseDetector(), baseline(5) + two)] == [6]
    with pytest.raises(ValueError, match="min_signals"):
        CollapseDetector(min_signals=0)


def test_signals_can_be_switched_off():
    d = CollapseDetector(kl_max=None, length_sigmas=None, ppl_drop=None, tail_factor=None, patience=1, min_signals=1)
    wild = {KL: 1e3, LENGTH: 1e3, PPL: 1e-3, TAIL: 1e3}
    assert stream(d, baseline(5) + [wild] * 3) == []


# ---------------------------------------------------------------- actions


class FakeModule(torch.nn.Module):
    """The RL module interface the alarm uses (lit_rlhf/modules/rl.py), on one parameter."""

    def __init__(self):
        super().__init__()
        from lit_rlhf.core.kl import FixedKLController
        from lit_rlhf.core.running_stats import RunningMoments

        self.w = torch.nn.Parameter(torch.zeros(2))
        self.kl_ctl = FixedKLController(0.05)
        self.reward_moments = RunningMoments()
        self.rl_iteration = 0
        self.logged = {}

    def log(self, name, value, **kw):
        self.logged[name] = value

    def scale_kl_coef(self, factor, floor=1e-3):
        old = self.kl_ctl.value
        self.kl_ctl.value = max(old, floor) * factor
        return old, self.kl_ctl.value

    def rl_state_dict(self):
        return {
            "iteration": self.rl_iteration,
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_moments": self.reward_moments.state_dict(),
        }

    def load_rl_state_dict(self, state):
        self.rl_iteration = state["iteration"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_moments.load_state_dict(state["reward_moments"])


def fake_trainer(module, tmp_path):
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    t = types.SimpleNamespace(
        callback_metrics={}, should_stop=False, optimizers=[opt], default_root_dir=str(tmp_path), saved=[]
    )
    t.save_checkpoint = lambda path: (t.saved.append(path), open(path, "w").close())
    return t


def drive(alarm, trainer, module, values, before_step=None):
    """One on_train_batch_end per metrics dict; ``before_step(i)`` may change the weights."""
    import os

    os.makedirs(os.path.join(trainer.default_root_dir, "checkpoints"), exist_ok=True)
    for i, m in enumerate(values):
        if before_step:
            before_step(i)
        trainer.callback_metrics = {k: torch.tensor(v) for k, v in m.items()}
        module.rl_iteration = i
        alarm.on_train_batch_end(trainer, module, {"rollout": object()}, None, i)
        if trainer.should_stop:
            return i
    return None


def test_warn_logs_reasons_and_counts(tmp_path, caplog):
    module, alarm = FakeModule(), CollapseAlarm(action="warn", kl_max=5.0, patience=1, min_signals=1)
    trainer = fake_trainer(module, tmp_path)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf.callbacks.collapse"):
        stopped = drive(alarm, trainer, module, baseline(5) + [dict(HEALTHY, **{KL: 7.0})] * 2)
    assert stopped is None and len(alarm.triggers) == 2 and module.logged["alarm/triggers"] == 2.0
    assert "collapse alarm at RL step 5 (warn): KL 7 > bound 5" in caplog.text


def test_stop_keeps_a_checkpoint_and_stops_cleanly(tmp_path):
    module, alarm = FakeModule(), CollapseAlarm(action="stop", ppl_drop=0.5, patience=2, min_signals=1)
    trainer = fake_trainer(module, tmp_path)
    stopped = drive(alarm, trainer, module, baseline(5) + [dict(HEALTHY, **{PPL: 1.0})] * 5)
    assert stopped == 6 and trainer.should_stop
    assert trainer.saved == [str(tmp_path / "checkpoints" / "collapse-step6.ckpt")]
    assert (tmp_path / "checkpoints" / "collapse-step6.ckpt").exists()


def test_rollback_restores_the_last_healthy_state_and_raises_beta(tmp_path):
    module = FakeModule()
    alarm = CollapseAlarm(action="rollback", kl_max=5.0, patience=1, snapshot_every=2, beta_factor=3.0, min_signals=1)
    trainer = fake_trainer(module, tmp_path)

    def train_step(i):  # "training" moves the weight every iteration: w = i
        with torch.no_grad():
            module.w.fill_(float(i))

    metrics = baseline(5) + [dict(HEALTHY, **{KL: 9.0})]
    drive(alarm, trainer, module, metrics, before_step=train_step)
    # healthy at 0..4; snapshots at the first healthy step (0) and every 2nd healthy one (1, 3)
    assert module.w.tolist() == [3.0, 3.0] and module.logged["alarm/rollback_to"] == 3.0
    assert module.kl_ctl.value == pytest.approx(0.15)


def test_rollback_is_refused_on_sharded_strategies():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    alarm = CollapseAlarm(action="rollback")
    trainer = types.SimpleNamespace(strategy=DeepSpeedStrategy(config={"zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match="use action=stop"):
        alarm.setup(trainer, None, "fit")


def test_bad_action():
    with pytest.raises(ValueError, match="warn, stop or rollback"):
        CollapseAlarm(action="panic")


def test_rollback_never_snapshots_an_iteration_that_waits_out_patience(tmp_path):
    """patience=2: iteration 5 is already alarming (the trigger comes at 6); the state to return
    to is iteration 4's, and the running reward statistics come back with the weights."""
    module = FakeModule()
    alarm = CollapseAlarm(action="rollback", kl_max=5.0, patience=2, snapshot_every=1, min_signals=1)
    trainer = fake_trainer(module, tmp_path)

    def train_step(i):  # w = i, and every iteration's score i enters the running moments
        with torch.no_grad():
            module.w.fill_(float(i))
        module.reward_moments.update(torch.tensor([float(i)]))

    drive(alarm, trainer, module, baseline(5) + [dict(HEALTHY, **{KL: 9.0})] * 2, before_step=train_step)
    assert alarm.triggers and alarm.triggers[0][0] == 6
    assert module.w.tolist() == [4.0, 4.0] and module.logged["alarm/rollback_to"] == 4.0
    assert module.reward_moments.count == 5 and module.reward_moments.mean == pytest.approx(2.0)  # scores 0..4


def test_a_second_rollback_raises_beta_again(tmp_path):
    """β is never restored from a snapshot: each rollback multiplies the current β, so repeated
    collapses escalate it (a restored β would undo the previous raise), and the iteration count
    goes on while the weights and the reward statistics come back."""
    module = FakeModule()
    alarm = CollapseAlarm(action="rollback", kl_max=5.0, patience=1, snapshot_every=100, beta_factor=2.0, min_signals=1)
    trainer = fake_trainer(module, tmp_path)

    def train_step(i):
        with torch.no_grad():
            module.w.fill_(float(i))
        module.reward_moments.update(torch.tensor([float(i)]))

    drive(alarm, trainer, module, baseline(5) + [dict(HEALTHY, **{KL: 9.0})] * 2, before_step=train_step)
    assert len(alarm.triggers) == 2 and module.kl_ctl.value == pytest.approx(0.05 * 2 * 2)
    assert module.w.tolist() == [0.0, 0.0]  # the only snapshot: the first healthy iteration
    assert module.reward_moments.count == 1 and module.rl_iteration == 6


def test_non_finite_values_alarm_on_their_own():
    """min_signals=2 asks for two signals together, but a NaN KL or skipped non-finite rewards are
    enough alone (after patience)."""
    d = CollapseDetector(patience=1, min_signals=2)
    assert stream(d, baseline(5) + [dict(HEALTHY, **{KL: float("nan")})]) == [(5, ["stability/kl is nan"])]
    d = CollapseDetector(patience=1, min_signals=2)
    got = stream(d, baseline(5) + [dict(HEALTHY, **{"health/nonfinite_scores": 4.0})])
    assert got == [(5, ["health/nonfinite_scores = 4"])]
