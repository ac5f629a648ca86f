"""The multi-process strategies the helper scripts run on CPU: DDP over gloo, real DeepSpeed ZeRO-2/3
and real FSDP through the test-only CPU strategies (tests/helpers/deepspeed_cpu.py, fsdp_cpu.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cpu_strategy(kind: str, micro_batch: int) -> Any:
    """``kind`` "ddp", "deepspeed" (ZeRO stage 2), "deepspeed3" (ZeRO stage 3) or "fsdp" (full
    shard, tests/helpers/fsdp_cpu.py); DeepSpeed with a global grad-norm clip of 1.0."""
    if kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=False)
    if kind == "fsdp":
        from tests.helpers.fsdp_cpu import cpu_fsdp_strategy

        return cpu_fsdp_strategy()
    from tests.helpers.deepspeed_cpu import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(
        config={
            # ZeRO-3 with no persistence threshold: every parameter partitioned, even the tiny ones
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
            if kind == "deepspeed3"
            else {"stage": 2},
            "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": micro_batch,
        }
    )


def run_parser(models_help: str, extra: list[tuple[str, dict[str, Any]]] = ()) -> argparse.ArgumentParser:
    """The command line of one run of a multi-process helper script: ``--strategy ddp|deepspeed|deepspeed3|fsdp``,
    ``--devices N``, ``--models DIR`` (``models_help`` says what it holds), ``--out DIR``, plus ``extra``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "deepspeed", "deepspeed3", "fsdp"], required=True)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--models", required=True, help=models_help)
    ap.add_argument("--out", required=True)
    for flag, kwargs in extra:
        ap.add_argument(flag, **kwargs)
    return ap


def split_runs(argv: list[str]) -> list[list[str]]:
    """A command line of several runs separated by ``--then`` → each run's arguments."""
    runs: list[list[str]] = [[]]
    for a in argv:
        runs.append([]) if a == "--then" else runs[-1].append(a)
    return runs


def multiproc_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> list[argparse.Namespace]:
    """A helper script's runs (``parser``: :func:`run_parser`'s), one or several separated by ``--then``,
    which the same processes run one after the other (each a fresh module, data module, strategy and
    trainer; the process group stays up). Process start-up (imports, the launcher re-executing the
    script for each rank) costs more than a few tiny-model steps, so the tests batch their runs (and
    tests/helpers/multiproc.py batches several scripts' runs). All runs share one ``--devices``."""
    parsed = [parser.parse_args(r) for r in split_runs(sys.argv[1:] if argv is None else argv)]
    if len({a.devices for a in parsed}) != 1:
        parser.error("every run of one launch needs the same --devices (the processes are started once)")
    return parsed


def wrapper_name(trainer: Any, model: Any) -> str:
    """What the strategy wrapped: its engine/DDP wrapper around the LightningModule, or under FSDP
    (which wraps each model the module holds instead) the type of ``model``."""
    from lit_rlhf.runtime.strategies import RLHFFSDPStrategy

    return type(model if isinstance(trainer.strategy, RLHFFSDPStrategy) else trainer.strategy.model).__name__


def whole_weights(trainer: Any, module: Any) -> Any:
    """A context in which the module's models have whole weights on every rank (their state dicts
    under clean names): ZeRO-3's partitions gathered, FSDP's full state dicts; else nothing to do."""
    import contextlib

    if getattr(trainer.strategy, "zero_stage_3", False):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    from lit_rlhf.runtime.strategies import RLHFFSDPStrategy

    if isinstance(trainer.strategy, RLHFFSDPStrategy):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False))
    return contextlib.nullcontext()
