"""Stability monitoring (docs/algorithms.md §4, docs/metrics.md): callbacks that read the rollout a module's
``training_step`` returns (no extra forwards), an alarm that acts on them, and the PNG report."""

from lit_rlhf.callbacks.collapse import CollapseAlarm, CollapseDetector
from lit_rlhf.callbacks.monitors import (
    KLMonitor,
    PerplexityMonitor,
    ResponseLengthMonitor,
    RewardStatsMonitor,
    RolloutMonitor,
    SamplesTable,
)
from lit_rlhf.callbacks.report import StabilityReport, WandbPanels

__all__ = [
    "CollapseAlarm",
    "CollapseDetector",
    "KLMonitor",
    "PerplexityMonitor",
    "ResponseLengthMonitor",
    "RewardStatsMonitor",
    "RolloutMonitor",
    "SamplesTable",
    "StabilityReport",
    "WandbPanels",
]
