"""The learning-rate schedule: linear warmup, then cosine to `lr × min_lr_ratio` at the last step.

A resumed run may change its length (`train.max_steps` / `train.num_epochs`). The rule then:
the learning rate continues from the value the checkpoint had reached, the warmup keeps its
length, and the rest of the cosine is stretched (or squeezed) over the steps that remain, so it
still ends at `lr × min_lr_ratio` at the new last step. The rate never jumps:

    factor(k) = (k + 1) / W                                 k < W (warmup)
              = min + (1 - min) · ½ (1 + cos(π · progress(k)))        otherwise
    progress(k) = p_a + (1 - p_a) · (k - a) / (T - a)       from the anchor a = max(W, s), the
                                                            step s the length changed at, whose
                                                            progress p_a the old schedule had

A run that never changed its length has a = W, p_a = 0: the plain warmup + cosine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Schedule:
    warmup_steps: int
    """W: optimizer steps of linear warmup."""
    total_steps: int
    """T: the last step (the cosine reaches its end there)."""
    min_ratio: float = 0.0
    """The cosine ends at lr × min_ratio."""
    anchor_step: int = 0
    """The step at which the length last changed (0: never)."""
    anchor_progress: float = 0.0
    """How far through the cosine (0..1) the schedule was at `anchor_step`."""

    def progress(self, step: int) -> float:
        w = self.warmup_steps
        a = max(w, self.anchor_step)
        if step >= a:
            return min(
                1.0,
                self.anchor_progress
                + (1.0 - self.anchor_progress) * (step - a) / max(1, self.total_steps - a),
            )
        # before the anchor (only for the record: a run never goes back)
        return self.anchor_progress * (step - w) / max(1, a - w)

    def factor(self, step: int) -> float:
        """lr multiplier of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        cos = 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))
        return self.min_ratio + (1.0 - self.min_ratio) * cos

    def lr_lambda(self):
        """The multiplier as a plain function for torch's LambdaLR.

        NOTE: not the object itself: LambdaLR saves the `__dict__` of callable objects in its
        state and a resume would then bring the old length back over the new one."""
        return lambda step: self.factor(step)

    def resized(self, at_step: int, total_steps: int) -> Schedule:
        """The same schedule continued from `at_step` to a new last step (see the module)."""
        if total_steps == self.total_steps:
            return self
        if at_step <= self.warmup_steps:
            return Schedule(self.warmup_steps, total_steps, self.min_ratio)
        return Schedule(
            self.warmup_steps, total_steps, self.min_ratio, at_step, self.progress(at_step)
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
    """lr multiplier of optimizer step k (0-based): linear warmup (k+1)/W, then cosine to
    min_ratio at the last step."""
    return Schedule(warmup_steps, total_steps, min_ratio).lr_lambda()
