"""The shapes a training step's activation memory depends on (the tuner's inventory).

Each drafter kind turns them into its activation terms (drafters/dspark/memory.py,
drafters/eagle3/memory.py); `dspark-ds tune` adds them to the ZeRO states (docs/tuner.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShapes:
    """One micro-batch of one rank, and the model sizes it flows through."""

    batch: int
    """B: sequences per micro-batch."""
    seq_len: int
    """S: tokens per sequence (data.max_length)."""
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_layers: int
    taps: int
    """Tapped target layers (n)."""
    compute_bytes: int
    """Bytes per element of the drafter's compute dtype (bf16: 2, fp32: 4)."""
    feature_bytes: int
    """Bytes per element of the target features (the target's dtype)."""

    def features_in(self) -> float:
        """The target features of the micro-batch: n tapped layers + the final state."""
        return self.batch * self.seq_len * (self.taps + 1) * self.hidden * self.feature_bytes
