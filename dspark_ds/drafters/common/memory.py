"""The shapes a training micro-batch's activation memory and FLOPs depend on (the tuner's input).

A `StepShape` is what every kind's step has (the micro-batch, the target's widths, the drafter's
depth and taps, the dtypes) and `drafter`, the kind's own part, which the kind builds from the
run's `model` section (`DrafterKind.cost.step_part`: drafters/dspark/memory.py
`DSparkShape`, drafters/eagle3/memory.py `Eagle3Shape`). Each kind turns a `StepShape` into its
activation terms (`cost.activation_bytes`) and its matmul FLOPs (`cost.step_flops`);
`dspark-ds tune` adds the bytes to the ZeRO states and divides the FLOPs by the cluster's rate (docs/tuner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dspark_ds.drafters.common.target_config import global_attr

LAYERS_RECOMPUTE = "draft_layers_recompute"
"""The FLOPs component of a kind's `step_flops` under perf.activation_checkpointing: the draft
layers' forward run again in backward (the tuner's `recompute` term)."""


@dataclass(frozen=True)
class Widths:
    """The target's and the drafter's widths the activations and FLOPs depend on (a `StepShape`
    has them, and the tuner's `Inventory` of the recipe)."""

    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_layers: int
    taps: int
    """Tapped target layers (n)."""

    @classmethod
    def of_config(cls, config, draft_layers: int, taps: int) -> Widths:
        """The widths of a target's text config as it stands (its own head size and KV heads),
        with the drafter's depth and taps."""
        return cls(
            hidden=int(global_attr(config, "hidden_size")),
            intermediate=int(global_attr(config, "intermediate_size")),
            vocab=int(global_attr(config, "vocab_size")),
            heads=int(global_attr(config, "num_attention_heads")),
            kv_heads=int(global_attr(config, "num_key_value_heads")),
            head_dim=int(global_attr(config, "head_dim")),
            draft_layers=draft_layers,
            taps=taps,
        )


@dataclass(frozen=True)
class StepShape(Widths):
    """One micro-batch of one rank, and the drafter sizes it flows through (its `Widths` first:
    `StepShape.of` names the micro-batch's own fields)."""

    batch: int
    """B: sequences per micro-batch."""
    seq_len: int
    """S: tokens per sequence (data.max_length)."""
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

    @classmethod
    def of(
        cls,
        widths: Widths,
        batch: int,
        seq_len: int,
        drafter: Any,
        compute_bytes: int = 2,
        feature_bytes: int = 2,
        **micro,
    ) -> StepShape:
        """The shape of `batch` sequences of `seq_len` tokens through `widths` (a `Widths`, or
        anything that is one, like the tuner's `Inventory`); `micro`: the micro-batch's other
        fields by name (aligned, attention; their defaults otherwise)."""
        own = {f.name: getattr(widths, f.name) for f in fields(Widths)}
        return cls(
            **own,
            batch=batch,
            seq_len=seq_len,
            drafter=drafter,
            compute_bytes=compute_bytes,
            feature_bytes=feature_bytes,
            **micro,
        )

    @property
    def context_tokens(self) -> int:
        return self.batch * self.seq_len

    def features_in(self) -> float:
        """Bytes of the micro-batch's target features: n tapped layers (+ the final state)."""
        layers = self.taps + (1 if self.aligned else 0)
        return float(self.batch * self.seq_len * layers * self.hidden * self.feature_bytes)
