"""DSpark's fields of the run's `model` section (`model.kind: dspark`, which covers DFlash), the
weights of its loss (docs/algorithm.md#the-loss), its presets, the size block that shrinks them
to a small target (`DSparkSizes`) and its registration.

`DSparkFields` are its fields of `DrafterConfig`, `REGISTRATION` what drafters/registry.py lists
(drafters/common/registration.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from dspark_ds.drafters.common.checks import Checker
from dspark_ds.drafters.common.divergences import (
    DPACE_ALPHA,
    LK_ETA,
    check_schedule,
    parse_terms,
)
from dspark_ds.drafters.common.registration import (
    CONFIDENCE_HEAD,
    DEEPSEEK_V4_CONFIG,
    MARKOV_HEAD,
    Capabilities,
    Claim,
    Preset,
    Registration,
    on_backbones,
)
from dspark_ds.drafters.dspark import serving, speculators_format
from dspark_ds.drafters.dspark.markov import MARKOV_HEAD_TYPES
from dspark_ds.drafters.perf import ATTN_IMPLEMENTATIONS, LOSS_IMPLEMENTATIONS
from dspark_ds.errors import ConfigError

CE_LABELS = ("data", "target")
"""What the cross-entropy's labels are (`model.ce_labels`)."""


def check_ce_labels(value: str, option: str = "model.ce_labels") -> None:
    if value not in CE_LABELS:
        raise ConfigError(f"{option}: expected one of {CE_LABELS}, got {value!r}")


@dataclass(frozen=True)
class LossWeights:
    """The weights of the DSpark loss (docs/algorithm.md#the-loss): the four of the paper, then
    the distribution terms and the position schedule (drafters/common/divergences.py; their
    defaults leave the paper's loss unchanged). Each is the `model` field of the same name."""

    loss_decay_gamma: float | None
    ce_loss_alpha: float
    l1_loss_alpha: float
    confidence_head_alpha: float
    loss_terms: tuple[tuple[str, float], ...] | Mapping[str, float] = ()
    """((name, weight), ...) of the active distribution terms; a mapping is read as one."""
    lk_eta: float = LK_ETA
    loss_schedule: str = "exp"
    loss_decay_ratio: float = 0.8
    dpace_alpha: float = DPACE_ALPHA
    ce_labels: str = "data"

    def __post_init__(self) -> None:
        # NOTE: a tuple keeps the frozen dataclass hashable and equal however it was spelt
        terms = self.loss_terms
        object.__setattr__(self, "loss_terms", parse_terms(dict(terms) if terms else None))
        check_schedule(self.loss_schedule)
        check_ce_labels(self.ce_labels)

    @property
    def dpace(self) -> bool:
        return self.loss_schedule == "dpace"

    @classmethod
    def of(cls, model: Any) -> LossWeights:
        """The weights a `model` section (a DSpark / DFlash one) sets: its fields of the same
        names."""
        return cls(**{f.name: getattr(model, f.name) for f in fields(cls)})


DSPARK_LOSS = LossWeights(
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
)
# DFlash: cross-entropy only, no confidence head (and no Markov head).
DFLASH_LOSS = replace(DSPARK_LOSS, ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)


BACKBONES = ("auto", "target")
V4_BACKBONE = "DSparkDraftModel"  # vLLM's architecture name for DeepSeek-V4's DSpark


@dataclass
class DSparkFields:
    """DSpark / DFlash: parallel blocks of γ tokens drafted from sampled anchors. Defaults are
    the paper's DSpark."""

    block_size: int = 7
    """γ: tokens drafted per block."""
    sample_from_anchor: bool = True
    """The block layout (docs/serving.md#the-block-layout). true: a block is [anchor, MASK ×
    (γ-1)] and every slot predicts the token after it, the anchor's slot the first draft
    (DeepSpec's layout, which vLLM's `dspark` method reads). false: [anchor, MASK × γ], each MASK
    predicting the token at its own position and the anchor's slot nothing (DFlash's layout, which
    vLLM's and SGLang's `dflash` methods read)."""
    num_anchors: int = 512
    """Blocks (anchors) sampled per training sequence."""
    markov_rank: int = 256
    """Rank r of the Markov head; 0 = no Markov head (DFlash)."""
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    """Markov head variant."""
    confidence_head_alpha: float = DSPARK_LOSS.confidence_head_alpha
    """Weight of the confidence (BCE) loss; > 0 enables the confidence head."""
    confidence_head_with_markov: bool = True
    """Feed the Markov features to the confidence head (needs markov_rank > 0)."""
    loss_decay_gamma: float | None = DSPARK_LOSS.loss_decay_gamma
    """Position weight decay w_j = exp(-j/γ_decay); None or <= 0 disables it."""
    ce_loss_alpha: float = DSPARK_LOSS.ce_loss_alpha
    """Weight of the cross-entropy term (DFlash: 1.0)."""
    l1_loss_alpha: float = DSPARK_LOSS.l1_loss_alpha
    """Weight of the L1 (2·total variation) term (DFlash: 0.0)."""
    loss_schedule: str = "exp"
    """Position weights of the loss in a block: "exp" (exp(-j/loss_decay_gamma), the paper's),
    "geometric" (loss_decay_ratio^j) or "dpace" (from the draft's own detached confidence
    exp(-CE): a slot weighs as much as the accepted tokens that need it; the confidence head's
    loss keeps "exp"). docs/algorithm.md#distribution-terms-and-position-schedules."""
    loss_decay_ratio: float = 0.8
    """r of loss_schedule "geometric": slot j weighs r^j."""
    dpace_alpha: float = DPACE_ALPHA
    """Smoothing a of loss_schedule "dpace": s = (1 - a)·exp(-CE) + a, in (0, 1]."""
    ce_labels: Literal["data", "target"] = "data"
    """The cross-entropy's labels: "data", each slot's next token of the training sequence (the
    paper's); "target", the target's own greedy token there, the argmax of its aligned logits
    over the draft vocabulary (what a T = 0 verification accepts; speculators' `ce` loss).
    D-PACE's weights and the greedy-acceptance metrics follow the labels. "target" reads the
    target's final hidden states (the cache keeps them, online mode computes them) and projects
    them onto the vocabulary once more (docs/algorithm.md#the-ce-labels)."""
    backbone: Literal["auto", "target"] = "auto"
    """The draft layers. auto: the target family's own for Qwen3 and Gemma4 targets, the
    Qwen3-style layers sized from the target for every other family. target: the target
    family's own decoder layers where the drafter has them (DeepSeek-V4: its sliding-window
    attention, MoE and hyper-connections, the layout vLLM's V4 DSpark serves; Qwen3, Gemma4:
    as auto); another family is refused by name (docs/drafters.md#deepseek-v4s-own-drafter)."""

    def check_fields(self, check: Checker) -> None:
        """These fields' checks (`DrafterConfig.validate`, when model.kind is dspark)."""
        check.at_least_1("block_size", "num_anchors")
        check("backbone", self.backbone in BACKBONES, f"expected one of {BACKBONES}")
        check("markov_rank", self.markov_rank >= 0, "must be >= 0")
        if self.markov_rank > 0:
            check(
                "markov_head_type",
                self.markov_head_type in MARKOV_HEAD_TYPES,
                f"expected one of {MARKOV_HEAD_TYPES}",
            )
        for name in ("confidence_head_alpha", "ce_loss_alpha", "l1_loss_alpha"):
            check(name, getattr(self, name) >= 0, "must be >= 0")
        # the common fields' distribution terms (presets.py) train too
        terms = getattr(check.cfg, "loss_terms", None) or {}
        check(
            "ce_loss_alpha",
            self.ce_loss_alpha + self.l1_loss_alpha + self.confidence_head_alpha > 0
            or any(w > 0 for w in terms.values()),
            "all loss weights are 0; nothing would be trained",
        )
        check_schedule(self.loss_schedule, check.name("loss_schedule"))
        check("loss_decay_ratio", 0 < self.loss_decay_ratio <= 1, "must be in (0, 1]")
        check("dpace_alpha", 0 < self.dpace_alpha <= 1, "must be in (0, 1]")
        check("ce_labels", self.ce_labels in CE_LABELS, f"expected one of {CE_LABELS}")
        if self.confidence_head_alpha > 0 and self.confidence_head_with_markov:
            check(
                "confidence_head_with_markov",
                self.markov_rank > 0,
                f"needs {check.name('markov_rank')} > 0 (DFlash has no Markov head: set it "
                "to false)",
            )


@dataclass
class DSparkSizes:
    """DSpark / DFlash sized to a small target (the demo's `drafter.dspark`, the bench's
    `sizes.dspark`): `model` fields set over the preset's."""

    num_draft_layers: int = 2
    """Backbone layers."""
    block_size: int = 7
    """γ: tokens drafted per block; the paper's 7."""
    num_anchors: int | None = None
    """Anchor blocks per training sequence; None = the preset's (512). The demo reads None as
    one block per valid anchor position of its longest training sequence, so that every valid
    position anchors a block of γ supervised slots, as Eagle3 is supervised at every position
    over its γ unrolled steps: equal supervision."""
    markov_rank: int = 64
    """DSpark's Markov head rank (DFlash has none)."""

    @property
    def draft_length(self) -> int:
        return self.block_size


def _blocks(s: DSparkSizes) -> dict[str, Any]:
    return dict(
        num_draft_layers=s.num_draft_layers, block_size=s.block_size, num_anchors=s.num_anchors
    )


# speculators' DSpark loss: KL to the target's distribution in place of CE 0.1 + L1 0.9 (the
# same exp(-j/4) position weights, which its fixed-exp-decay γ 4 also is; the same BCE 1.0)
KL_LOSS = {"loss_terms": {"kl": 1.0}, "ce_loss_alpha": 0.0, "l1_loss_alpha": 0.0}
# the demo's DSpark loss: speculators' KL plus 0.5 × the cross-entropy against the target's
# greedy token (T = 0's own objective), both with D-PACE position weights: the best of the
# mixes measured on the demo's work, at both temperatures (docs/peers.md#dsparks-loss)
KL_CE_LOSS = {**KL_LOSS, "ce_loss_alpha": 0.5, "ce_labels": "target", "loss_schedule": "dpace"}
# speculators' DFlash loss: cross-entropy against the target's greedy token (its `ce`), D-PACE
# position weights (α 0.5)
DPACE_LOSS = {"loss_schedule": "dpace", "ce_labels": "target"}
# the demo's DFlash loss: speculators' plus 0.5 × KL to the target's distribution, read in a
# random order of the sequences (no length grouping): level with speculators at T = 0 and ahead
# at T = 1 over six trainings a side and seed (docs/peers.md#dflashs-loss-and-order)
KL_DPACE_LOSS = {**DPACE_LOSS, "loss_terms": {"kl": 0.5}}
RANDOM_ORDER = {"length_grouping": 1}
# the demo's DFlash optimizer: Muon's momentum 0.9 (0.95 both sides otherwise): above the same
# training at 0.95 at T = 0 in nine draws of nine, level at T = 1 (docs/peers.md#muons-momentum)
MUON_MOMENTUM_09 = {"muon_momentum": 0.9}

# What a DSpark behind DFlash at the first position only means (docs/study.md#the-first-position:
# at 3 layers DSpark led there in 3 of 3 seeds at 4x the demo's steps, in 2 at 1x, 1 at 2x)
FIRST_POSITION = (
    "position 0: DSpark's Markov head reads the anchor there, which the backbone sees too, so "
    "the first draft is the backbone's in both, trained with the same greedy-token CE and "
    "D-PACE weights: at the demo's 480 steps the seed's draw decides, with 4x the steps "
    "(--budget.max_steps 1920) DSpark led there in every seed (measured with DFlash's Muon at "
    "momentum 0.95); docs/study.md#the-first-position"
)

PRESETS: dict[str, Preset] = {
    # the paper's DSpark: 5 layers, γ 7, 512 anchors, vanilla Markov head of rank 256, the
    # confidence head fed the Markov features, CE / L1 / BCE 0.1 / 0.9 / 1.0 (the defaults)
    "dspark": Preset(
        label="DSpark",
        fields={},
        sized=lambda s: {**_blocks(s), "markov_rank": s.markov_rank},
        claims=(
            Claim("tau", "dflash", 1.0, 1.10),
            Claim("tau", "dflash", 0.0, 1.0),
            Claim("acceptance", "dflash", 0.0, 1.0, FIRST_POSITION),
            Claim("tau", "eagle3", 1.0, 1.0),
            Claim("speedup", "eagle3", 1.0, 1.0),
        ),
        speculators_loss=KL_LOSS,
        demo_loss=KL_CE_LOSS,
    ),
    # DFlash: DSpark without the Markov and confidence heads, cross-entropy only, in DFlash's
    # own block layout (what the engines' DFlash path serves)
    "dflash": Preset(
        label="DFlash",
        fields=dict(
            markov_rank=0,
            confidence_head_with_markov=False,
            sample_from_anchor=False,
            loss_decay_gamma=DFLASH_LOSS.loss_decay_gamma,
            ce_loss_alpha=DFLASH_LOSS.ce_loss_alpha,
            l1_loss_alpha=DFLASH_LOSS.l1_loss_alpha,
            confidence_head_alpha=DFLASH_LOSS.confidence_head_alpha,
        ),
        # NOTE: sized, it keeps DSpark's block layout, not the preset's: the demo's comparison
        # isolates the heads (the README's figures were measured so); docs/serving.md
        sized=lambda s: {**_blocks(s), "sample_from_anchor": True},
        speculators_loss=DPACE_LOSS,
        demo_loss=KL_DPACE_LOSS,
        demo_data=RANDOM_ORDER,
        demo_train=MUON_MOMENTUM_09,
    ),
}

_BACKBONES = on_backbones("dspark_ds.drafters.dspark", "DSparkModel")
_BACKBONES["backends"][V4_BACKBONE] = (
    "dspark_ds.drafters.dspark.deepseek_v4",
    "DeepseekV4DSparkModel",
    DEEPSEEK_V4_CONFIG,
)

REGISTRATION = Registration(
    name="dspark",
    fields=DSparkFields,
    kind_class="dspark_ds.drafters.dspark.kind:DSpark",
    presets=PRESETS,
    sizes=DSparkSizes,
    # the demo's DSpark / DFlash depth (Eagle3 keeps its one layer, as in the paper): the depth
    # whose DSpark drafted the most at the demo's budget in docs/study.md's grid (τ at T = 1
    # 2.38 / 2.62 / 3.01 / 2.85 for 1 / 2 / 3 / 5 layers, seed 0), about 8 s more per training
    # than 2 layers
    demo_sizes={"num_draft_layers": 3},
    **_BACKBONES,
    target_backbones={"deepseek_v4": V4_BACKBONE},
    serving=serving,
    speculators=speculators_format,
    capabilities=Capabilities(
        label="DSpark / DFlash",
        drafting="parallel",
        uses_mask_token=True,
        anchor_blocks=True,
        heads=(MARKOV_HEAD, CONFIDENCE_HEAD),
        # model.sample_from_anchor true / false (docs/serving.md#the-block-layout)
        block_layouts=("anchor", "fill-in"),
        loss_impls=LOSS_IMPLEMENTATIONS,
        attn_impls=("auto", *ATTN_IMPLEMENTATIONS),
        bench_variants=(
            "dense/reference",
            "blockwise/reference",
            "dense/chunked",
            "blockwise/chunked",
        ),
    ),
)
