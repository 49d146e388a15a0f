"""The drafter section of a run (`model`) and the variants the paper trains, each written once,
both built from the registered kinds (drafters/registry.py).

`DrafterConfig` is the fields every kind reads (`kind`, the layers, the MASK token, a start
from an export) and, as its bases, each registered kind's own fields with their checks
(drafters/dspark/config.py `DSparkFields`, drafters/eagle3/config.py `Eagle3Fields`): a recipe is
one flat `model:` mapping, and a kind reads its own fields and ignores the others. Its defaults
are the first kind's (the paper's DSpark).

`PRESETS` are the kinds' presets, the paper's drafters of its Table 1 (DSpark, DFlash, Eagle3):
each a `model` section, the name reports give it, how the demo and the bench size it to a small
target (`sized`), and the claims the paper makes of it against the others (`Claim`; the demo
checks them). The shipped recipes (tests/unit/test_recipes.py pins that they agree with the
preset they name), the demo, the training bench and the tests build their drafters from here.
docs/algorithm.md explains every field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from dspark_ds.drafters.common.checks import Checker
from dspark_ds.drafters.common.registration import Preset
from dspark_ds.drafters.registry import REGISTERED
from dspark_ds.errors import ConfigError

KIND_NAMES = tuple(REGISTERED)
"""The `model.kind` values; the first is the default."""


@dataclass
class DrafterFields:
    """What every kind reads."""

    kind: Literal[KIND_NAMES] = KIND_NAMES[0]
    """Drafter family: "dspark" (DSpark / DFlash, parallel blocks) or "eagle3" (the
    autoregressive Eagle3 baseline; reads num_draft_layers, ttt_length, step_loss_decay)."""
    num_draft_layers: int = 5
    """Transformer layers of the drafter backbone."""
    mask_token_id: int | None = None
    """Id of the MASK token filling a draft block (kinds that use one); None = the tokenizer's
    `<|mask|>` token (Qwen3 recipes use 151669)."""
    init_from: str | None = None
    """Start from an exported drafter directory instead of a random init (fine-tuning)."""


# each kind's fields after the common ones, in the registry's order (a dataclass collects its
# fields from the last base to the first)
_KIND_FIELDS = tuple(reversed([r.fields for r in REGISTERED.values()]))


@dataclass
class DrafterConfig(*_KIND_FIELDS, DrafterFields):
    """The drafter's architecture and loss (docs/algorithm.md): the common fields, then each
    kind's. Defaults are the paper's DSpark; `dspark_ds.drafters.presets.preset` gives DFlash
    and Eagle3."""

    def validate(self, prefix: str | None = "model") -> DrafterConfig:
        """Checks the fields the drafter kind reads; raises ConfigError naming the option
        (`prefix.field`; the bare field name when `prefix` is None)."""
        check = Checker(self, prefix)
        check("kind", self.kind in REGISTERED, f"must be one of {' / '.join(REGISTERED)}")
        check.at_least_1("num_draft_layers")
        REGISTERED[self.kind].fields.check_fields(self, check)
        return self

    def kind_fields(self) -> tuple[str, ...]:
        """The fields this section's kind reads: the common ones and its own."""
        own = REGISTERED[self.kind].fields
        return tuple(f.name for cls in (DrafterFields, own) for f in fields(cls))


PRESETS: dict[str, Preset] = {n: p for r in REGISTERED.values() for n, p in r.presets.items()}
_PRESET_KIND = {n: r.name for r in REGISTERED.values() for n in r.presets}
DEFAULT_PRESET = next(iter(PRESETS))
"""The preset whose `model` section is `DrafterConfig()`'s defaults (the first kind's first)."""
PRESET_NAMES = tuple(PRESETS)


def _known(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown drafter {name!r}; choose from {PRESET_NAMES}")
    return PRESETS[name]


def preset(name: str, **overrides) -> DrafterConfig:
    """A fresh copy of the named preset (dspark | dflash | eagle3) with `overrides` applied."""
    own = _known(name).fields
    return replace(DrafterConfig(kind=_PRESET_KIND[name], **own), **overrides)


def preset_fields(name: str) -> dict[str, object]:
    """The fields a preset sets that its drafter kind reads (what a recipe must agree with)."""
    cfg = preset(name)
    return {
        k: getattr(cfg, k) for k in cfg.kind_fields() if k not in ("mask_token_id", "init_from")
    }


def sized(name: str, sizes) -> DrafterConfig:
    """The preset `name` sized to a small target by `sizes` (the demo's `drafter` section, the
    bench's config)."""
    return preset(name, **_known(name).sized(sizes))
