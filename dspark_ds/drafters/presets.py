"""The drafter section of a run (`model`) and the variants the paper trains, each written once.

`DrafterConfig`'s defaults are the paper's DSpark; `preset("dflash")` and `preset("eagle3")` are
the other two drafters of its Table 1. The shipped recipes (tests/unit/test_recipes.py pins that they
agree with the preset they name), the demo, the training bench and the tests build their drafters
from here; the losses take their default weights from `DSPARK_LOSS`. docs/algorithm.md explains
every field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from dspark_ds.drafters.dspark.markov import MARKOV_HEAD_TYPES
from dspark_ds.errors import ConfigError


@dataclass(frozen=True)
class LossWeights:
    """The weights of the DSpark loss (docs/algorithm.md#the-loss)."""

    loss_decay_gamma: float | None
    ce_loss_alpha: float
    l1_loss_alpha: float
    confidence_head_alpha: float


DSPARK_LOSS = LossWeights(
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
)
# DFlash: cross-entropy only, no confidence head (and no Markov head).
DFLASH_LOSS = replace(DSPARK_LOSS, ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)
# Eagle3: the loss of unrolled step k is weighted by STEP_LOSS_DECAY ** k.
STEP_LOSS_DECAY = 0.8


@dataclass
class DrafterConfig:
    """The drafter's architecture and loss (docs/algorithm.md). Defaults are the paper's DSpark;
    `dspark_ds.drafters.presets.preset` gives DFlash and Eagle3."""

    kind: Literal["dspark", "eagle3"] = "dspark"
    """Drafter family: "dspark" (DSpark / DFlash, parallel blocks) or "eagle3" (the
    autoregressive Eagle3 baseline; reads num_draft_layers, ttt_length, step_loss_decay)."""
    num_draft_layers: int = 5
    """Transformer layers of the drafter backbone."""
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
    mask_token_id: int | None = None
    """Id of the MASK token filling the draft block; None = the tokenizer's `<|mask|>` token
    (Qwen3 recipes use 151669)."""
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
    ttt_length: int = 7
    """Eagle3: training-time-test steps unrolled per position; also tokens drafted per round."""
    step_loss_decay: float = STEP_LOSS_DECAY
    """Eagle3: the loss of unrolled step k is weighted by step_loss_decay^k."""
    init_from: str | None = None
    """Start from an exported drafter directory instead of a random init (fine-tuning)."""

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(
            loss_decay_gamma=self.loss_decay_gamma,
            ce_loss_alpha=self.ce_loss_alpha,
            l1_loss_alpha=self.l1_loss_alpha,
            confidence_head_alpha=self.confidence_head_alpha,
        )

    def validate(self, prefix: str | None = "model") -> DrafterConfig:
        """Checks the fields the drafter kind reads; raises ConfigError naming the option
        (`prefix.field`; the bare field name when `prefix` is None)."""
        check = _Checker(self, prefix)
        if self.kind == "eagle3":
            check.at_least_1("num_draft_layers", "ttt_length")
            check("step_loss_decay", self.step_loss_decay > 0, "must be > 0")
            return self
        check("kind", self.kind == "dspark", "must be dspark or eagle3")
        check.at_least_1("num_draft_layers", "block_size", "num_anchors")
        check("markov_rank", self.markov_rank >= 0, "must be >= 0")
        if self.markov_rank > 0:
            check(
                "markov_head_type",
                self.markov_head_type in MARKOV_HEAD_TYPES,
                f"expected one of {MARKOV_HEAD_TYPES}",
            )
        for name in ("confidence_head_alpha", "ce_loss_alpha", "l1_loss_alpha"):
            check(name, getattr(self, name) >= 0, "must be >= 0")
        check(
            "ce_loss_alpha",
            self.ce_loss_alpha + self.l1_loss_alpha + self.confidence_head_alpha > 0,
            "all loss weights are 0; nothing would be trained",
        )
        if self.confidence_head_alpha > 0 and self.confidence_head_with_markov:
            check(
                "confidence_head_with_markov",
                self.markov_rank > 0,
                f"needs {check.name('markov_rank')} > 0 (DFlash has no Markov head: set it "
                "to false)",
            )
        return self


class _Checker:
    def __init__(self, cfg: DrafterConfig, prefix: str | None):
        self.cfg, self.prefix = cfg, prefix

    def name(self, field: str) -> str:
        return f"{self.prefix}.{field}" if self.prefix else field

    def __call__(self, field: str, ok: bool, why: str) -> None:
        if not ok:
            raise ConfigError(f"{self.name(field)}: {why}, got {getattr(self.cfg, field)!r}")

    def at_least_1(self, *fields: str) -> None:
        for field in fields:
            self(field, getattr(self.cfg, field) >= 1, "must be >= 1")


_PRESETS: dict[str, DrafterConfig] = {
    # the paper's DSpark: 5 layers, γ 7, 512 anchors, vanilla Markov head of rank 256, the
    # confidence head fed the Markov features, CE / L1 / BCE 0.1 / 0.9 / 1.0
    "dspark": DrafterConfig(),
    # DFlash: DSpark without the Markov and confidence heads, cross-entropy only, in DFlash's
    # own block layout (what the engines' DFlash path serves)
    "dflash": DrafterConfig(
        markov_rank=0,
        confidence_head_with_markov=False,
        sample_from_anchor=False,
        **asdict(DFLASH_LOSS),
    ),
    # Eagle3: one autoregressive layer unrolled over 7 training-time-test steps
    # (ttt_length and step_loss_decay: DrafterConfig's defaults)
    "eagle3": DrafterConfig(kind="eagle3", num_draft_layers=1),
}


PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides) -> DrafterConfig:
    """A fresh copy of the named preset (dspark | dflash | eagle3) with `overrides` applied."""
    if name not in _PRESETS:
        raise ConfigError(f"preset: unknown drafter {name!r}; choose from {PRESET_NAMES}")
    return replace(_PRESETS[name], **overrides)


def preset_fields(name: str) -> dict[str, object]:
    """The fields a preset sets that its drafter kind reads (what a recipe must agree with)."""
    cfg = preset(name)
    if cfg.kind == "eagle3":
        keys = ("kind", "num_draft_layers", "ttt_length", "step_loss_decay")
    else:
        keys = tuple(
            k
            for k in asdict(cfg)
            if k not in ("mask_token_id", "init_from", "ttt_length", "step_loss_decay")
        )
    return {k: getattr(cfg, k) for k in keys}
