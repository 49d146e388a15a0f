"""The shapes a training micro-batch's activation memory and FLOPs depend on (the tuner's input).

Each drafter kind turns a `StepShape` into its activation terms (`DrafterKind.activation_bytes`)
and its matmul FLOPs (`DrafterKind.step_flops`): drafters/dspark/memory.py,
drafters/eagle3/memory.py; `dspark-ds tune` adds the bytes to the ZeRO states and divides the
FLOPs by the cluster's rate (docs/tuner.md). A kind reads the fields it depends on and ignores
the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """One micro-batch of one rank, and the drafter sizes it flows through."""

    batch: int
    """B: sequences per micro-batch."""
    seq_len: int
    """S: tokens per sequence (data.max_length)."""
    num_anchors: int
    """A: anchor blocks per sequence (DSpark / DFlash)."""
    block_size: int
    """γ: tokens per block (DSpark / DFlash)."""
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_layers: int
    taps: int
    """Tapped target layers (n)."""
    markov_rank: int
    """r of the Markov head; 0 = none (DSpark / DFlash)."""
    markov_head_type: str = "vanilla"
    """The Markov head's form: vanilla | gated | rnn (DSpark's FLOPs)."""
    compute_bytes: int = 2
    """Bytes per element of the drafter's compute dtype (bf16: 2, fp32: 4)."""
    feature_bytes: int = 2
    """Bytes per element of the target features (the target's dtype)."""
    confidence_head: bool = True
    """The confidence head is trained (DSpark)."""
    aligned: bool = True
    """The target's last hidden states are in the batch (DSpark's L1 term and confidence head;
    Eagle3's soft targets)."""
    ttt_length: int = 7
    """T: training-time-test steps unrolled per position (Eagle3)."""

    @property
    def draft_tokens(self) -> int:
        """T = B·A·γ draft slots of a DSpark step (at most one anchor per position)."""
        return self.batch * min(self.num_anchors, self.seq_len) * self.block_size

    @property
    def context_tokens(self) -> int:
        return self.batch * self.seq_len

    def features_in(self) -> float:
        """Bytes of the micro-batch's target features: n tapped layers (+ the final state)."""
        layers = self.taps + (1 if self.aligned else 0)
        return float(self.batch * self.seq_len * layers * self.hidden * self.feature_bytes)
