"""``RLStage``: what the callbacks may use of an RL stage (docs/architecture.md "Interfaces").

The monitors, the collapse alarm, the progress bar and the W&B panels talk to an RL stage only
through these members, never through its class or private attributes; ``lit_rlhf.modules.rl.RLModule``
implements them, and so may any LightningModule a user writes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RLStage(Protocol):
    """An RL stage as the callbacks see it. Its ``training_step`` returns ``{"rollout": Rollout,
    "stats": dict}``, which Lightning's manual loop hands to ``on_train_batch_end``."""

    @property
    def rl_iteration(self) -> int:
        """RL iterations completed: the x-axis of every RL panel and of the alarm's reports."""
        ...

    @property
    def kl_coef(self) -> float:
        """The current β."""
        ...

    def scale_kl_coef(self, factor: float, floor: float = 1e-3) -> tuple[float, float]:
        """β ← max(β, floor) · factor; returns (old, new) (the alarm's rollback)."""
        ...

    def rl_state_dict(self) -> dict[str, Any]:
        """Non-parameter state (iteration, KL controller, running statistics): checkpoints, snapshots."""
        ...

    def load_rl_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rl_state_dict` returned."""
        ...

    def updates_per_iteration(self, batch_size: int | None = None) -> int:
        """Optimizer steps of one RL iteration (the progress bar's iteration budget)."""
        ...


def rl_stage(module: Any) -> RLStage | None:
    """``module`` when it is an RL stage, else None (SFT, reward model, DPO)."""
    return module if isinstance(module, RLStage) else None
