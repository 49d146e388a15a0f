"""The Eagle3 baseline as a variant of any DSpark training run (demo, comparisons).

Table 1 of the paper compares drafters trained the same way on the same data. Given a
DSpark / DFlash `TrainRunConfig`, `eagle3_run_config` returns the Eagle3 run that differs
only in the `model` section (one layer, `ttt_length` = the block size γ so every drafter
proposes at most γ tokens a round, `step_loss_decay` 0.8): same target and tapped layers,
data, schedule, learning rate, steps, engine, checkpointing and tracking.
"""

from __future__ import annotations

import copy

from dspark_ds.config import DrafterConfig, TrainRunConfig


def eagle3_run_config(
    base: TrainRunConfig,
    *,
    name: str | None = None,
    num_draft_layers: int = 1,
    ttt_length: int | None = None,
    step_loss_decay: float = 0.8,
) -> TrainRunConfig:
    """The Eagle3 counterpart of `base` (a deep copy; `base` is not modified)."""
    cfg = copy.deepcopy(base)
    cfg.model = DrafterConfig(
        kind="eagle3",
        num_draft_layers=num_draft_layers,
        ttt_length=int(ttt_length if ttt_length is not None else base.model.block_size),
        step_loss_decay=step_loss_decay,
    )
    cfg.name = name or f"{base.name}_eagle3"
    cfg.model.validate()
    return cfg
