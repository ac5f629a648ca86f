"""What strategy a composed config asks for, read from its ``strategy`` node without building it
(the runner's cross-group checks and the memory plan both need it)."""

from __future__ import annotations

from typing import Any


def strategy_kind(cfg: Any) -> tuple[str, bool, bool]:
    """(ddp | fsdp | zero2 | zero3, optimizer offload, parameter offload) of a composed config's strategy."""
    node = cfg.get("strategy")
    target = str(node.get("_target_", "")) if hasattr(node, "get") else str(node or "")
    if "DeepSpeed" in target or "deepspeed" in target.lower():
        zero = (node.get("config") or {}).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        opt_off = str((zero.get("offload_optimizer") or {}).get("device", "none")) == "cpu"
        par_off = str((zero.get("offload_param") or {}).get("device", "none")) == "cpu"
        return ("zero3" if stage == 3 else "zero2"), opt_off, par_off
    if "fsdp" in target.lower():
        return "fsdp", False, False
    return "ddp", False, False
