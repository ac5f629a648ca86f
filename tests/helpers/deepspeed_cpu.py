"""TEST ONLY: lit_rlhf's DeepSpeed strategy (RLHFDeepSpeedStrategy, Lightning's DeepSpeedStrategy as
the stages use it) on a CPU accelerator, running real DeepSpeed ZeRO-2/3 over gloo.

Lightning refuses DeepSpeed without CUDA. Three small overrides make its real code path run on
CPU processes, so CI (no GPU) exercises ZeRO-2 engine wrapping, manual_backward through the
engine, engine.step and generate() under the engine:

1. ``setup_environment``: DDP's (skips the CUDA check);
2. ``setup_distributed``: no device-index validation (CPU devices have no index);
3. ``deepspeed.initialize(args=Namespace(device_rank=local_rank))``: the CPU device has no index;
4. no shared-memory allreduce op (DeepSpeed would JIT-compile it on every fresh machine): gloo's.
Never use this for real training: DeepSpeed's CPU path is slow and untuned.
"""

from __future__ import annotations

import argparse

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy

from lit_rlhf.runtime.strategies import RLHFDeepSpeedStrategy


class CPUDeepSpeedStrategy(RLHFDeepSpeedStrategy):
    strategy_name = "deepspeed_cpu_test"

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        import importlib

        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # (the package's `torch` attribute is torch)
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce op (~30 s with ninja on a
        # fresh machine, every CI run); gloo's allreduce is what these tests need
        ds_torch_comm.build_shm_op = lambda: None
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer
