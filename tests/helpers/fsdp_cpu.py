"""TEST ONLY: lit_rlhf's FSDP strategy (RLHFFSDPStrategy, Lightning's FSDPStrategy as ``strategy=fsdp``
builds it) on a CPU accelerator, running real FSDP1 over gloo.

Lightning refuses ``strategy="fsdp"`` without a GPU only for its own class (a subclass passes), and
FSDP1 refuses a CPU module unless told the device: Lightning passes ``device_id=None`` (CPU devices
have no index), which FSDP takes as "find an accelerator". This subclass names the CPU device;
everything else is lit_rlhf's, Lightning's and torch's own code path. Never use it for training.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rlhf.utils.strategies import RLHFFSDPStrategy


class CPUFSDPStrategy(RLHFFSDPStrategy):
    strategy_name = "fsdp_cpu_test"

    def fsdp_device_id(self) -> Any:
        return torch.device("cpu")


def cpu_fsdp_strategy(**kwargs: Any) -> CPUFSDPStrategy:
    """``conf/strategy/fsdp.yaml``'s wrapping (Llama decoder blocks) and sharding, over gloo."""
    kwargs.setdefault("wrap_layers", ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"])
    return CPUFSDPStrategy(process_group_backend="gloo", sharding_strategy="FULL_SHARD", state_dict_type="full", **kwargs)
