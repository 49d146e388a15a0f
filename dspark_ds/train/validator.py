"""Validation during training: the loss terms and τ on held-out batches, every
`validation.every_steps` optimizer steps and at the last step.

    validator.should_validate(step, last_step=...)
    validator.validate(engine, step) -> the held-out batches' `StepOutput`s

Every validation reads the same held-out batches (the source is rewound to where it started).
Their metric sums stay on the device: the metrics logger sums them over the ranks with the
training steps' on the next log step (`MetricsLogger.log_step`, `validation_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark_ds.config import ValidationConfig
from dspark_ds.drafters.kind import StepOutput


class Validator:
    def __init__(self, cfg: ValidationConfig, source):
        """`source`: a batch source of held-out data (`train.batches`), or None (no validation)."""
        self.cfg = cfg
        self.source = source
        self.start = source.state_dict() if source is not None else None

    def should_validate(self, step: int, *, last_step: bool) -> bool:
        if self.source is None:
            return False
        every = self.cfg.every_steps
        return last_step or (bool(every) and step % every == 0)

    def validate(self, engine, step: Callable[[dict], StepOutput]) -> list[StepOutput]:
        """`validation.num_batches` micro-batches of this rank, through `step` without
        gradients."""
        self.source.load_state_dict(self.start)
        outputs: list[StepOutput] = []
        engine.eval()
        with torch.no_grad():
            for i, batch in enumerate(self.source):
                if i >= self.cfg.num_batches:
                    break
                outputs.append(step(batch))
        engine.train()
        return outputs
