"""Stability monitoring (docs/algorithms.md §4, docs/metrics.md): callbacks that read the rollout a module's
``training_step`` returns (no extra forwards), an alarm that acts on them, and the stability dashboard
(``stability.png``, :mod:`lit_rlhf.callbacks.dashboard`: ``python -m lit_rlhf.callbacks.dashboard RUN_DIR``).
The callbacks import Lightning when first used, so the dashboard alone stays light."""

from lit_rlhf.utils.lazy import lazy_names

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

_LAZY = {
    "CollapseAlarm": "collapse",
    "CollapseDetector": "collapse",
    "KLMonitor": "monitors",
    "PerplexityMonitor": "monitors",
    "ResponseLengthMonitor": "monitors",
    "RewardStatsMonitor": "monitors",
    "RolloutMonitor": "monitors",
    "SamplesTable": "monitors",
    "StabilityReport": "report",
    "WandbPanels": "report",
}


__getattr__ = lazy_names(__name__, _LAZY)
