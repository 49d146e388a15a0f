"""Validation during training: the loss terms and τ on held-out batches, every
`validation.every_steps` optimizer steps and at the last step.

    validator.should_validate(step, last_step=...)
    validator.validate(engine, forward_loss) -> {"val/loss": ..., "val/tau_probabilistic": ...}

Every validation reads the same held-out batches (the source is rewound to where it started).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark_ds.config import ValidationConfig


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

    def validate(self, engine, forward_loss: Callable) -> dict[str, float]:
        """Collective (every rank validates its share). Means over `validation.num_batches`
        micro-batches per rank of the (already globally reduced) metrics."""
        self.source.load_state_dict(self.start)
        sums: dict[str, float] = {}
        n = 0
        engine.eval()
        with torch.no_grad():
            for i, batch in enumerate(self.source):
                if i >= self.cfg.num_batches:
                    break
                _, metrics = forward_loss(batch)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        engine.train()
        return {f"val/{k}": v / max(n, 1) for k, v in sums.items()}
