"""The drafter section of a run (`model`) and the variants the paper trains, each written once.

`DrafterConfig` is the fields every kind reads (`kind`, the layers, the MASK token, a start
from an export) and, as its bases, each kind's own fields with their checks
(drafters/dspark/config.py `DSparkFields`, drafters/eagle3/config.py `Eagle3Fields`): a recipe is
one flat `model:` mapping, and a kind reads its own fields and ignores the others. Its defaults
are the paper's DSpark.

`PRESETS` are the paper's drafters of its Table 1 (DSpark, DFlash, Eagle3): each a `model`
section, the name reports give it, how the demo sizes it to a small target (`sized`), and the
claims the paper makes of it against the others (`Claim`; the demo checks them). The shipped
recipes (tests/unit/test_recipes.py pins that they agree with the preset they name), the demo, the
training bench and the tests build their drafters from here. docs/algorithm.md explains every
field.

A new kind adds its fields class to `DrafterConfig`'s bases, its name to `DrafterConfig.kind`,
and its presets to `PRESETS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from dspark_ds.drafters.common.checks import Checker
from dspark_ds.drafters.dspark.config import DFLASH_LOSS, DSparkFields
from dspark_ds.drafters.eagle3.config import Eagle3Fields
from dspark_ds.errors import ConfigError

# model.kind -> the fields class of that kind (one base of DrafterConfig each)
KIND_FIELDS: dict[str, type] = {f.KIND: f for f in (DSparkFields, Eagle3Fields)}


@dataclass
class DrafterFields:
    """What every kind reads."""

    kind: Literal["dspark", "eagle3"] = "dspark"
    """Drafter family: "dspark" (DSpark / DFlash, parallel blocks) or "eagle3" (the
    autoregressive Eagle3 baseline; reads num_draft_layers, ttt_length, step_loss_decay)."""
    num_draft_layers: int = 5
    """Transformer layers of the drafter backbone."""
    mask_token_id: int | None = None
    """Id of the MASK token filling a draft block (kinds that use one); None = the tokenizer's
    `<|mask|>` token (Qwen3 recipes use 151669)."""
    init_from: str | None = None
    """Start from an exported drafter directory instead of a random init (fine-tuning)."""


@dataclass
class DrafterConfig(Eagle3Fields, DSparkFields, DrafterFields):
    """The drafter's architecture and loss (docs/algorithm.md): the common fields, then each
    kind's. Defaults are the paper's DSpark; `dspark_ds.drafters.presets.preset` gives DFlash
    and Eagle3."""

    def validate(self, prefix: str | None = "model") -> DrafterConfig:
        """Checks the fields the drafter kind reads; raises ConfigError naming the option
        (`prefix.field`; the bare field name when `prefix` is None)."""
        check = Checker(self, prefix)
        check("kind", self.kind in KIND_FIELDS, f"must be one of {' / '.join(KIND_FIELDS)}")
        check.at_least_1("num_draft_layers")
        KIND_FIELDS[self.kind].check_fields(self, check)
        return self

    def kind_fields(self) -> tuple[str, ...]:
        """The fields this section's kind reads: the common ones and its own."""
        own = KIND_FIELDS[self.kind]
        return tuple(f.name for cls in (DrafterFields, own) for f in fields(cls))


@dataclass(frozen=True)
class Claim:
    """The paper's claim of a preset against another one: `metric` (tau | speedup) of this
    preset over `over`'s at `temperature` is at least `at_least`, in every seed."""

    metric: str
    over: str
    temperature: float
    at_least: float


@dataclass(frozen=True)
class Preset:
    """One of the paper's drafters."""

    label: str
    """How reports name it."""
    model: DrafterConfig
    """Its `model` section at the paper's sizes."""
    sized: Callable[[Any], dict[str, Any]]
    """The overrides that size it to a small target, from the demo's `drafter` section (its
    fields: num_draft_layers, block_size, num_anchors, markov_rank, unrolled_layers)."""
    claims: tuple[Claim, ...] = ()


def _blocks(d) -> dict[str, Any]:
    return dict(num_draft_layers=d.num_draft_layers, block_size=d.block_size,
                num_anchors=d.num_anchors)  # fmt: skip


PRESETS: dict[str, Preset] = {
    # the paper's DSpark: 5 layers, γ 7, 512 anchors, vanilla Markov head of rank 256, the
    # confidence head fed the Markov features, CE / L1 / BCE 0.1 / 0.9 / 1.0
    "dspark": Preset(
        label="DSpark",
        model=DrafterConfig(),
        sized=lambda d: {**_blocks(d), "markov_rank": d.markov_rank},
        claims=(
            Claim("tau", "dflash", 1.0, 1.10),
            Claim("tau", "dflash", 0.0, 1.0),
            Claim("speedup", "eagle3", 1.0, 1.0),
        ),
    ),
    # DFlash: DSpark without the Markov and confidence heads, cross-entropy only, in DFlash's
    # own block layout (what the engines' DFlash path serves)
    "dflash": Preset(
        label="DFlash",
        model=DrafterConfig(
            markov_rank=0,
            confidence_head_with_markov=False,
            sample_from_anchor=False,
            **asdict(DFLASH_LOSS),
        ),
        # NOTE: sized, it keeps DSpark's block layout, not the preset's: the demo's comparison
        # isolates the heads (the README's figures were measured so); docs/serving.md
        sized=lambda d: {**_blocks(d), "sample_from_anchor": True},
    ),
    # Eagle3: one autoregressive layer unrolled over 7 training-time-test steps
    # (ttt_length and step_loss_decay: DrafterConfig's defaults)
    "eagle3": Preset(
        label="Eagle3",
        model=DrafterConfig(kind="eagle3", num_draft_layers=1),
        # ttt_length = γ: every drafter proposes at most γ tokens a round, and is trained on
        # the same γ next tokens of every position
        sized=lambda d: {"num_draft_layers": d.unrolled_layers, "ttt_length": d.block_size},
    ),
}


PRESET_NAMES = tuple(PRESETS)


def _known(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown drafter {name!r}; choose from {PRESET_NAMES}")
    return PRESETS[name]


def preset(name: str, **overrides) -> DrafterConfig:
    """A fresh copy of the named preset (dspark | dflash | eagle3) with `overrides` applied."""
    return replace(_known(name).model, **overrides)


def preset_fields(name: str) -> dict[str, object]:
    """The fields a preset sets that its drafter kind reads (what a recipe must agree with)."""
    cfg = preset(name)
    return {
        k: getattr(cfg, k) for k in cfg.kind_fields() if k not in ("mask_token_id", "init_from")
    }


def sized(name: str, sizes) -> DrafterConfig:
    """The preset `name` sized to a small target by `sizes` (the demo's `drafter` section)."""
    return preset(name, **_known(name).sized(sizes))
