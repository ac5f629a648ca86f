"""TEST ONLY: lit_rlhf's FSDP strategy (RLHFFSDPStrategy, Lightning's FSDPStrategy as ``strategy=fsdp``
builds it) on a CPU accelerator, running real FSDP1 over gloo.

Lightning refuses ``strategy="fsdp"`` without a GPU only for its own class (a subclass passes), and
FSDP1 refuses a CPU module unless told the device: Lightning passes ``device_id=None`` (CPU devices
have no index), which FSDP takes as "find an accelerator". This subclass names the CPU device.
Two torch FSDP1 paths rely on ``.cpu()`` making a copy, which it does not for CPU tensors, and
the test strategy works around both (CPU devices only; GPUs take torch's path unchanged):

* the full model state dict with ``offload_to_cpu=True`` (Lightning always asks for it) frees the
  gathered weights it returns views of: a segfault. The test strategy gathers without offload.
* the full optimizer state dict gathers each state (``exp_avg``, ``exp_avg_sq`` …) into ONE
  reused buffer and keeps views of it: every state of a checkpoint would hold the last one's
  values. The test strategy copies each state as it is gathered.

Everything else is lit_rlhf's, Lightning's and torch's own code path. Never use it for training.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rlhf.runtime.strategies import RLHFFSDPStrategy


def _full_state_dict_context_without_offload(module: Any, world_size: int, rank0_only: bool = True) -> Any:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        module,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=rank0_only),
        FullOptimStateDictConfig(rank0_only=rank0_only),
    )


def _copy_gathered_optimizer_states() -> None:
    from torch.distributed.fsdp import _optim_utils

    unflatten = _optim_utils._unflatten_orig_param_states
    if getattr(unflatten, "copies", False):
        return

    def unflatten_and_copy(fsdp_param_info, output_states, state_name, *args, **kwargs):
        unflatten(fsdp_param_info, output_states, state_name, *args, **kwargs)
        for states in output_states.values():  # views of the buffer the next state is gathered into
            if torch.is_tensor(states.get(state_name)):
                states[state_name] = states[state_name].clone()

    unflatten_and_copy.copies = True
    _optim_utils._unflatten_orig_param_states = unflatten_and_copy


class CPUFSDPStrategy(RLHFFSDPStrategy):
    strategy_name = "fsdp_cpu_test"

    def __init__(self, **kwargs: Any) -> None:
        import lightning.pytorch.strategies.fsdp as lightning_fsdp

        lightning_fsdp._get_full_state_dict_context = _full_state_dict_context_without_offload
        _copy_gathered_optimizer_states()
        super().__init__(**kwargs)

    def fsdp_device_id(self) -> Any:
        return torch.device("cpu")


def cpu_fsdp_strategy(**kwargs: Any) -> CPUFSDPStrategy:
    """``lit_rlhf/conf/strategy/fsdp.yaml``'s wrapping (Llama decoder blocks) and sharding, over gloo."""
    kwargs.setdefault("wrap_layers", ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"])
    return CPUFSDPStrategy(
        process_group_backend="gloo", sharding_strategy="FULL_SHARD", state_dict_type="full", **kwargs
    )
