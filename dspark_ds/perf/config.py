"""The performance knobs of a training step (one config section, read by the trainer)."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_ds.drafters.common.attention import ATTN_IMPLEMENTATIONS
from dspark_ds.drafters.dspark.loss_chunked import DEFAULT_CHUNK_ANCHORS

LOSS_IMPLEMENTATIONS = ("auto", "reference", "chunked", "recompute")


@dataclass
class PerfConfig:
    """How the training step computes attention and the loss (results are the same)."""

    loss_impl: str = "auto"
    """"reference": full [B, A, G, V] logits (the golden-tested path); "chunked": the
    vocabulary-sized work a few anchors at a time, same loss and gradients with
    O(loss_chunk_anchors × G × V) memory, each chunk's gradient computed in closed form as it
    goes; "recompute": the same chunks under activation checkpointing (logits computed twice;
    what "chunked" becomes under ZeRO-3, whose partitioned head weights only module calls
    may touch); "auto" = "chunked". Eagle3: auto | reference | chunked, "auto" = "reference"
    under ZeRO-3."""

    loss_chunk_anchors: int = DEFAULT_CHUNK_ANCHORS
    """Anchors (blocks, over the whole micro-batch) per chunk of the chunked loss. Small
    keeps the chunk in CPU cache; on GPU 64-256 amortise kernel launches. Eagle3: positions,
    each ttt_length rows."""

    attn_implementation: str = "auto"
    """Block-mask attention of the training forward: "flex" (GPU), "blockwise" (exact, skips
    masked work; CPU training path), "dense" (full boolean mask, reference) or "auto"
    (flex on CUDA, blockwise elsewhere). Eagle3: auto (flex on CUDA, dense elsewhere) | flex |
    dense."""

    def __post_init__(self) -> None:
        if self.loss_impl not in LOSS_IMPLEMENTATIONS:
            raise ValueError(
                f"perf.loss_impl: expected one of {LOSS_IMPLEMENTATIONS}, got {self.loss_impl!r}"
            )
        if self.loss_chunk_anchors < 1:
            raise ValueError(
                f"perf.loss_chunk_anchors: must be >= 1, got {self.loss_chunk_anchors}"
            )
        allowed = ("auto", *ATTN_IMPLEMENTATIONS)
        if self.attn_implementation not in allowed:
            raise ValueError(
                f"perf.attn_implementation: expected one of {allowed}, "
                f"got {self.attn_implementation!r}"
            )
