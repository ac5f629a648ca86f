"""The multi-process strategies the helper scripts run on CPU: DDP over gloo, or real DeepSpeed ZeRO-2
through the test-only CPU strategy (tests/helpers/deepspeed_cpu.py)."""

from __future__ import annotations

from typing import Any


def cpu_strategy(kind: str, micro_batch: int) -> Any:
    """``kind`` "ddp" or "deepspeed" (ZeRO stage 2, global grad-norm clip 1.0)."""
    if kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=False)
    from tests.helpers.deepspeed_cpu import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(config={
        "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": micro_batch,
    })  # fmt: skip
