"""The shapes a training micro-batch's activation memory and FLOPs depend on (the tuner's input).

A `StepShape` is what every kind's step has (the micro-batch, the target's widths, the drafter's
depth and taps, the dtypes) and `drafter`, the kind's own part, which the kind builds from the
run's `model` section (`DrafterKind.cost.step_part`: drafters/dspark/memory.py
`DSparkShape`, drafters/eagle3/memory.py `Eagle3Shape`). Each kind turns a `StepShape` into its
activation terms (`cost.activation_bytes`) and its matmul FLOPs (`cost.step_flops`);
`dspark-ds tune` adds the bytes to the ZeRO states and divides the FLOPs by the cluster's rate (docs/tuner.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYERS_RECOMPUTE = "draft_layers_recompute"
"""The FLOPs component of a kind's `step_flops` under perf.activation_checkpointing: the draft
layers' forward run again in backward (the tuner's `recompute` term)."""


@dataclass(frozen=True)
class StepShape:
    """One micro-batch of one rank, and the drafter sizes it flows through."""

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
    drafter: Any
    """The kind's part of the shape (`DrafterKind.cost.step_part` of the run's `model` section)."""
    compute_bytes: int = 2
    """Bytes per element of the drafter's compute dtype (bf16: 2, fp32: 4)."""
    feature_bytes: int = 2
    """Bytes per element of the target features (the target's dtype)."""
    aligned: bool = True
    """The target's last hidden states are in the batch (what a kind's loss compares with)."""
    attention: str | None = None
    """The attention path the drafter's layers force whatever perf.attn_implementation says
    (DeepSeek-V4's own layers: "dense", for their per-head sink); None: the perf section's."""

    @property
    def context_tokens(self) -> int:
        return self.batch * self.seq_len

    def features_in(self) -> float:
        """Bytes of the micro-batch's target features: n tapped layers (+ the final state)."""
        layers = self.taps + (1 if self.aligned else 0)
        return float(self.batch * self.seq_len * layers * self.hidden * self.feature_bytes)
