"""torch internals (pinned torch==2.13.0; lit_rlhf/utils/compat/__init__.py): oneDNN's prepacked
linear operators, the module hook registries the decoding step checks before inlining, and the
thread-count setter a CPU vLLM engine replaces."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_rlhf.utils.compat import private_attr


def mkldnn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear operators (x86-64 CPU wheels do;
    elsewhere the decoding step multiplies with ``F.linear``: a fallback, not an error)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def mkldnn_reorder_linear_weight(weight: Tensor, rows: int) -> Tensor:
    """``weight`` (out, in) reordered into oneDNN's blocked layout for ``rows`` input rows."""
    op = private_attr(torch.ops.mkldnn, "_reorder_linear_weight", "torch", "torch.ops.mkldnn._reorder_linear_weight")
    return op(weight, rows)


def mkldnn_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, W, b)`` with ``W`` from :func:`mkldnn_reorder_linear_weight`."""
    op = private_attr(torch.ops.mkldnn, "_linear_pointwise", "torch", "torch.ops.mkldnn._linear_pointwise")
    return op(x, packed_weight, bias, "none", [], "")


def global_forward_hooks_active() -> bool:
    """Whether any global module forward (pre-)hook is registered (``register_module_forward_hook``)."""
    from torch.nn.modules import module

    hooks = private_attr(module, "_global_forward_hooks", "torch", "torch.nn.modules.module._global_forward_hooks")
    pre = private_attr(
        module, "_global_forward_pre_hooks", "torch", "torch.nn.modules.module._global_forward_pre_hooks"
    )
    return bool(hooks or pre)


def has_forward_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` itself has forward or forward-pre hooks (ZeRO-3, FSDP, peft and users add them)."""
    hooks = private_attr(m, "_forward_hooks", "torch", "nn.Module._forward_hooks")
    return bool(hooks or private_attr(m, "_forward_pre_hooks", "torch", "nn.Module._forward_pre_hooks"))


def set_num_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` that takes effect where a CPU vLLM engine was built in this
    process: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process
    once it has bound its threads (a colocated engine, built in the trainer for validation or the
    synchronous rollout), and the async rollouts' thread split would silently leave the trainer all
    of them beside the producer's. The builtin it replaced is still ``torch._C.set_num_threads``."""
    private_attr(torch._C, "set_num_threads", "torch", "torch._C.set_num_threads")(n)
