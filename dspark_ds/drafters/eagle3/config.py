"""Eagle3's fields of the run's `model` section (`model.kind: eagle3`).

`Eagle3Fields` is one base of `DrafterConfig` (drafters/presets.py): the recipe stays one flat
`model:` mapping, and these fields, their documentation and their checks live here, with the
kind that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark_ds.drafters.common.checks import Checker

# the loss of unrolled step k is weighted by STEP_LOSS_DECAY ** k
STEP_LOSS_DECAY = 0.8


@dataclass
class Eagle3Fields:
    """Eagle3: one autoregressive layer unrolled over training-time-test steps."""

    KIND: ClassVar[str] = "eagle3"

    ttt_length: int = 7
    """Eagle3: training-time-test steps unrolled per position; also tokens drafted per round."""
    step_loss_decay: float = STEP_LOSS_DECAY
    """Eagle3: the loss of unrolled step k is weighted by step_loss_decay^k."""

    def check_fields(self, check: Checker) -> None:
        """These fields' checks (`DrafterConfig.validate`, when model.kind is eagle3)."""
        check.at_least_1("ttt_length")
        check("step_loss_decay", self.step_loss_decay > 0, "must be > 0")
