"""Eagle3's fields of the run's `model` section (`model.kind: eagle3`), its preset, the size
block that shrinks it to a small target (`Eagle3Sizes`) and its registration.

`Eagle3Fields` are its fields of `DrafterConfig`, `REGISTRATION` what drafters/registry.py lists
(drafters/common/registration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_ds.drafters.common.checks import Checker
from dspark_ds.drafters.common.registration import (
    Capabilities,
    Preset,
    Registration,
    on_backbones,
)
from dspark_ds.drafters.eagle3 import serving, speculators_format
from dspark_ds.drafters.eagle3.model import TTT_ATTN_IMPLEMENTATIONS

# the loss of unrolled step k is weighted by STEP_LOSS_DECAY ** k
STEP_LOSS_DECAY = 0.8
# perf.loss_impl values Eagle3 honours (eagle3/loss.py's paths)
LOSS_IMPLEMENTATIONS = ("auto", "reference", "chunked")


@dataclass
class Eagle3Fields:
    """Eagle3: one autoregressive layer unrolled over training-time-test steps."""

    ttt_length: int = 7
    """Eagle3: training-time-test steps unrolled per position; also tokens drafted per round."""
    step_loss_decay: float = STEP_LOSS_DECAY
    """Eagle3: the loss of unrolled step k is weighted by step_loss_decay^k."""

    def check_fields(self, check: Checker) -> None:
        """These fields' checks (`DrafterConfig.validate`, when model.kind is eagle3)."""
        check.at_least_1("ttt_length")
        check("step_loss_decay", self.step_loss_decay > 0, "must be > 0")


@dataclass
class Eagle3Sizes:
    """Eagle3 sized to a small target (the demo's `drafter.eagle3`, the bench's
    `sizes.eagle3`): `model` fields set over the preset's."""

    num_draft_layers: int = 1
    """Layers unrolled once per drafted token (the paper's baseline has one)."""
    ttt_length: int = 7
    """Training-time-test steps, also tokens drafted per round: the others' γ (7), so that every
    drafter proposes at most γ tokens a round and is trained on the same γ next tokens of every
    position."""

    @property
    def draft_length(self) -> int:
        return self.ttt_length


PRESETS: dict[str, Preset] = {
    # Eagle3: one autoregressive layer unrolled over 7 training-time-test steps
    # (ttt_length and step_loss_decay: the defaults)
    "eagle3": Preset(
        label="Eagle3",
        fields=dict(num_draft_layers=1),
        sized=lambda s: {"num_draft_layers": s.num_draft_layers, "ttt_length": s.ttt_length},
        # its soft cross-entropy is KL to the target's distribution plus a constant (the
        # same gradients); speculators weighs every TTT step 1.0. The demo keeps decay 0.8
        # (demo_loss {}): with Muon it drafted better than with 1.0 (docs/demo.md)
        speculators_loss={"step_loss_decay": 1.0},
    ),
}

REGISTRATION = Registration(
    name="eagle3",
    fields=Eagle3Fields,
    kind_class="dspark_ds.drafters.eagle3.kind:Eagle3",
    presets=PRESETS,
    sizes=Eagle3Sizes,
    **on_backbones("dspark_ds.drafters.eagle3", "Eagle3Model"),
    serving=serving,
    speculators=speculators_format,
    capabilities=Capabilities(
        label="Eagle3",
        drafting="unrolled",
        uses_mask_token=False,
        anchor_blocks=False,
        heads=(),
        block_layouts=(),
        loss_impls=LOSS_IMPLEMENTATIONS,
        attn_impls=("auto", *TTT_ATTN_IMPLEMENTATIONS),
        bench_variants=("dense/reference", "dense/chunked"),  # flex: CUDA only (no CPU backward)
    ),
)
