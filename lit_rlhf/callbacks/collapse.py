"""Collapse alarm (docs/algorithms.md §4): watch the MOSS-RLHF triad (KL, length, perplexity) and
the reward tail against the run's own early baseline, and act: warn, stop cleanly, or roll back
and raise β.

MOSS-RLHF §5.2: a collapsing policy shows reward up while KL rises, responses lengthen and
perplexity falls, and the reward distribution grows a long tail; loss and reward alone look fine.
Collapse shows in SEVERAL of these at once: one alone is normal RL fine-tuning (perplexity halves
as any policy sharpens on its reward — the healthy PPO-max run of the demo does exactly that), so
by default an alarm needs ``min_signals=2`` of them in the same iteration. Non-finite values (of
these metrics, or rewards the stage had to skip: ``health/*``) alarm on their own.

:class:`CollapseDetector` is the pure logic (a stream of metric dicts in, reasons out); the
callback feeds it the values the monitors logged this iteration (so it must come AFTER the
monitors in the callback list, as in lit_rlhf/conf/callbacks/rlhf.yaml).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl

log = logging.getLogger(__name__)

KL, LENGTH, PPL, TAIL = "stability/kl", "stability/response_length", "stability/perplexity", "reward/tail_ratio"
NONFINITE_SCORES, SKIPPED_UPDATES = "health/nonfinite_scores", "health/skipped_updates"
WATCHED = (KL, LENGTH, PPL, TAIL, NONFINITE_SCORES, SKIPPED_UPDATES)


@dataclass
class CollapseDetector:
    """Signals, each off when its bound is None.

    Args:
        baseline_steps: observations that form the baseline (no alarm before it is complete).
        kl_max: absolute bound on the sequence KL (nats).
        length_sigmas: alarm when |length − μ₀| > k·max(σ₀, min_length_sigma).
        ppl_drop: alarm when perplexity < (1 − drop) · baseline perplexity.
        tail_factor: alarm when the reward tail ratio > factor · its baseline.
        min_signals: signals that must alarm in the same observation for it to count as alarming
            (1 = any single signal).
        patience: consecutive alarming observations before a trigger.
    """

    baseline_steps: int = 5
    kl_max: float | None = 20.0
    length_sigmas: float | None = 4.0
    min_length_sigma: float = 1.0
    ppl_drop: float | None = 0.5
    tail_factor: float | None = 4.0
    min_signals: int = 2
    patience: int = 2
    baseline: dict[str, list[float]] = field(default_factory=dict)
    alarming: bool = False
    """Whether the latest observation was alarming (a trigger, or one still waiting out patience)."""
    _streak: int = 0

    def __post_init__(self) -> None:
        if self.min_signals < 1 or self.patience < 1:
            raise ValueError(f"min_signals and patience must be >= 1, got {self.min_signals}, {self.patience}")

    def _stats(self, key: str) -> tuple[float, float] | None:
        values = self.baseline.get(key, [])
        if len(values) < self.baseline_steps:
            return None
        return statistics.fmean(values), statistics.pstdev(values)

    def critical(self, metrics: dict[str, float]) -> list[str]:
        """Reasons that alarm on their own, whatever ``min_signals``: non-finite values of the
        watched metrics, non-finite rewards the RL stage had to skip."""
        reasons = [f"{k} is {v}" for k, v in metrics.items() if not math.isfinite(v)]
        for key in (NONFINITE_SCORES, SKIPPED_UPDATES):
            if metrics.get(key, 0.0) > 0:
                reasons.append(f"{key} = {metrics[key]:g}")
        return reasons

    def check(self, metrics: dict[str, float]) -> list[str]:
        """Reasons this observation is alarming (empty = healthy); does not update state."""
        reasons = []
        kl = metrics.get(KL)
        if self.kl_max is not None and kl is not None and kl > self.kl_max:
            reasons.append(f"KL {kl:.3g} > bound {self.kl_max:g}")
        base = self._stats(LENGTH)
        length = metrics.get(LENGTH)
        if self.length_sigmas is not None and base and length is not None:
            mu, sd = base
            if abs(length - mu) > self.length_sigmas * max(sd, self.min_length_sigma):
                reasons.append(f"response length {length:.3g} drifted > {self.length_sigmas:g}σ from baseline {mu:.3g}")
        base = self._stats(PPL)
        ppl = metrics.get(PPL)
        if self.ppl_drop is not None and base and ppl is not None and ppl < (1 - self.ppl_drop) * base[0]:
            reasons.append(f"perplexity {ppl:.3g} fell below {(1 - self.ppl_drop):.2g} x baseline {base[0]:.3g}")
        base = self._stats(TAIL)
        tail = metrics.get(TAIL)
        if self.tail_factor is not None and base and tail is not None and tail > self.tail_factor * max(base[0], 1e-6):
            reasons.append(f"reward tail ratio {tail:.3g} > {self.tail_factor:g} x baseline {base[0]:.3g}")
        return reasons

    def observe(self, metrics: dict[str, float]) -> list[str]:
        """Feed one iteration's metrics; returns the reasons when the alarm TRIGGERS, i.e. after
        ``patience`` alarming observations (``min_signals`` or more reasons each) in a row. The
        first ``baseline_steps`` observations of each relative signal form its baseline (only the
        absolute KL bound applies meanwhile)."""
        critical = self.critical(metrics)
        reasons = critical + self.check({k: v for k, v in metrics.items() if math.isfinite(v)})
        self.alarming = len(reasons) >= self.min_signals or bool(critical)
        for key in (LENGTH, PPL, TAIL):
            values = self.baseline.setdefault(key, [])
            if key in metrics and math.isfinite(metrics[key]) and len(values) < self.baseline_steps:
                values.append(metrics[key])
        self._streak = self._streak + 1 if self.alarming else 0
        if self._streak >= self.patience:
            self._streak = 0
            return reasons
        return []


class CollapseAlarm(pl.Callback):
    """Act on :class:`CollapseDetector` triggers during RL training.

    Actions: ``warn`` (log the reasons, count in ``alarm/triggers``), ``stop`` (save a checkpoint
    ``collapse-step<N>.ckpt`` next to the other checkpoints and stop cleanly), ``rollback``
    (restore the snapshot of the last healthy iteration — module weights, optimizer state and the
    module's RL state (:meth:`~lit_rlhf.callbacks.protocol.RLStage.rl_state_dict`: iteration, β, running
    reward statistics), kept in CPU memory every ``snapshot_every`` healthy iterations — then
    multiply β by ``beta_factor``; the step budget and lr schedule go on). An iteration is healthy
    when it is not alarming, including while an alarm waits out its patience. Every trigger is
    logged with its reasons.

    It talks to the RL module only through its public interface (docs/architecture.md
    "Interfaces"): ``rl_iteration``, ``scale_kl_coef``, ``rl_state_dict``/``load_rl_state_dict``.
    """

    def __init__(
        self,
        action: Literal["warn", "stop", "rollback"] = "warn",
        beta_factor: float = 2.0,
        snapshot_every: int = 5,
        checkpoint_dir: str | None = None,
        **detector: Any,
    ) -> None:
        if action not in ("warn", "stop", "rollback"):
            raise ValueError(f"action must be warn, stop or rollback, got {action!r}")
        self.action = action
        self.beta_factor = beta_factor
        self.snapshot_every = snapshot_every
        self.checkpoint_dir = checkpoint_dir
        self.detector = CollapseDetector(**detector)
        self.triggers: list[tuple[int, list[str]]] = []
        self._snapshot: dict[str, Any] | None = None
        self._healthy = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.action == "rollback":
            from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

            if isinstance(trainer.strategy, (DeepSpeedStrategy, FSDPStrategy)):
                raise ValueError(
                    "CollapseAlarm(action=rollback) keeps in-memory snapshots, which sharded "
                    "strategies do not support; use action=stop (and resume with a higher β)"
                )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not (isinstance(outputs, dict) and "rollout" in outputs):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in WATCHED}
        step = pl_module.rl_iteration
        reasons = self.detector.observe(metrics)
        if reasons:
            self.triggers.append((step, reasons))
        pl_module.log("alarm/triggers", float(len(self.triggers)), on_step=True)
        if not reasons:
            if not self.detector.alarming:  # an iteration waiting out patience is no state to return to
                self._healthy += 1
                if self.action == "rollback" and (self._snapshot is None or self._healthy % self.snapshot_every == 0):
                    self._snapshot = self._take_snapshot(trainer, pl_module, step)
            return
        log.warning(f"collapse alarm at RL step {step} ({self.action}): " + "; ".join(reasons))
        if self.action == "stop":
            self._stop(trainer, step)
        elif self.action == "rollback":
            self._rollback(trainer, pl_module)

    # ---------------------------------------------------------------- actions
    def _stop(self, trainer: pl.Trainer, step: int) -> None:
        directory = self.checkpoint_dir or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(directory, f"collapse-step{step}.ckpt")
        trainer.save_checkpoint(path)  # collective: every rank reaches this with the same metrics
        log.warning("collapse alarm: checkpoint kept at %s; training stops", path)
        trainer.should_stop = True

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> dict[str, Any]:
        to_cpu = lambda sd: {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}  # noqa: E731
        return {
            "step": step,
            "module": to_cpu(pl_module.state_dict()),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in trainer.optimizers],
            # the running reward statistics saw the collapsing rollouts too
            "rl_state": copy.deepcopy(pl_module.rl_state_dict()),
        }

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._snapshot is None:
            log.warning("collapse alarm: no healthy snapshot yet, nothing to roll back to")
            return
        pl_module.load_state_dict(self._snapshot["module"])
        for opt, state in zip(trainer.optimizers, self._snapshot["optimizers"]):
            opt.load_state_dict(state)
        # the rest of the RL state comes back (e.g. the running reward statistics), except the
        # iteration count (the logs' x-axis goes on) and β (raised below; a restored β would
        # undo the raise of an earlier rollback)
        current = pl_module.rl_state_dict()
        restored = copy.deepcopy(self._snapshot["rl_state"])
        pl_module.load_rl_state_dict({**restored, "iteration": current["iteration"], "kl_ctl": current["kl_ctl"]})
        old, new = pl_module.scale_kl_coef(self.beta_factor)
        log.warning("collapse alarm: rolled back to RL step %d; β %.4g -> %.4g", self._snapshot["step"], old, new)
        pl_module.log("alarm/rollback_to", float(self._snapshot["step"]), on_step=True)

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.detector.baseline, "triggers": self.triggers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.baseline = state["baseline"]
        self.triggers = state["triggers"]
