"""The drafter section of a run (`model`) and the variants the paper trains, each written once,
both built from the registered kinds (drafters/registry.py).

`DrafterConfig` is one flat dataclass: the fields every kind reads (`kind`, the layers, the MASK
token, a start from an export), declared below, then each registered kind's own fields, declared
in its folder (drafters/dspark/config.py `DSparkFields`, drafters/eagle3/config.py
`Eagle3Fields`) and appended by `with_kind_fields`. A recipe is one flat `model:` mapping and the
options are `--model.<field>`; a kind reads the common fields and its own and ignores the others.
Its defaults are the first kind's (the paper's DSpark).

`PRESETS` are the kinds' presets, the paper's drafters of its Table 1 (DSpark, DFlash, Eagle3):
each a `model` section, the name reports give it, how the demo and the bench size it to a small
target (`sized`, from its kind's size block: `DrafterSizes`), and the claims the paper makes of it
against the others (`Claim`; the demo checks them). The shipped recipes
(tests/unit/test_recipes.py pins that they agree with the preset they name), the demo, the
training bench and the tests build their drafters from here. docs/algorithm.md explains every
field.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import Field, dataclass, field, fields, make_dataclass, replace
from typing import Any, Literal, get_type_hints

from dspark_ds.drafters.common.checks import Checker
from dspark_ds.drafters.common.divergences import LK_ETA, parse_terms
from dspark_ds.drafters.common.registration import Preset
from dspark_ds.drafters.registry import REGISTERED
from dspark_ds.errors import ConfigError

KIND_NAMES = tuple(REGISTERED)
"""The `model.kind` values; the first is the default."""


# ---- composing a section from the kinds' field groups ------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls` (what --help shows), from its
    source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        a.target.id: inspect.cleandoc(b.value.value)
        for a, b in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    }


def made_dataclass(base: type, specs: list[tuple[str, Any, Field, str]]) -> type:
    """A dataclass named as `base`, with `base` as its one base: `base`'s fields, then `specs`
    ((name, type, field, docstring) each, in order).

    NOTE: a made class has no source, where jsonargparse reads a field's docstring for --help:
    the specs' docstrings go to the class docstring's `Attributes:` section, which it also
    reads (and `help()` shows)."""
    attributes = "\n".join(
        f"    {name}: " + doc.replace("\n", "\n        ") for name, _, _, doc in specs
    )
    made = make_dataclass(
        base.__name__,
        [(name, hint, f) for name, hint, f, _ in specs],
        bases=(base,),
        namespace={
            "__doc__": f"{inspect.cleandoc(base.__doc__ or '')}\n\nAttributes:\n{attributes}\n"
        },
    )
    made.__module__ = base.__module__  # pickling finds it by module and name
    return made


def _copy(f: Field) -> Field:
    return field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)


def with_kind_fields(common: type) -> type:
    """`common` (a dataclass: the fields every kind reads, and the section's methods) followed
    by each registered kind's own fields (`Registration.fields`, in the registry's order), as one
    flat dataclass of the same name. Each field keeps its kind's type, default and docstring; no
    two kinds may declare the same field."""
    owner = {f.name: "the common fields" for f in fields(common)}
    specs = []
    for r in REGISTERED.values():
        hints, docs = get_type_hints(r.fields), field_docs(r.fields)
        for f in fields(r.fields):
            if f.name in owner:
                raise TypeError(f"model.{f.name}: declared by {owner[f.name]} and by {r.name}")
            owner[f.name] = r.name
            specs.append((f.name, hints[f.name], _copy(f), docs.get(f.name, "")))
    return made_dataclass(common, specs)


# ---- the `model` section -----------------------------------------------------------------------
@with_kind_fields
@dataclass
class DrafterConfig:
    """The drafter's architecture and loss (docs/algorithm.md): the fields every kind reads,
    declared here, then each registered kind's own (`with_kind_fields`; listed under
    Attributes). Defaults are the paper's DSpark; `preset` gives DFlash and Eagle3."""

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
    draft_vocab_size: int | None = None
    """Draft over the N most frequent target tokens of the training data (counted once, beside
    the data): the head is the target's rows of them, frozen, written with EAGLE-3's d2t / t2d
    maps; a token outside is never proposed. None or 0: the whole vocabulary (the target's own
    head)."""
    loss_terms: dict[str, float] = field(default_factory=dict)
    """Distribution terms added to the loss, name → weight, against the target's aligned
    distribution: kl (KL(p_target‖q_draft)), rkl (reverse KL), jsd, tv (1 - overlap), nla
    (-log overlap), lk (exp(-lk_eta·overlap) blend of kl and tv); e.g. {"tv": 0.9}. {} = none
    (docs/algorithm.md#distribution-terms-and-position-schedules)."""
    lk_eta: float = LK_ETA
    """η of the lk term: its weight on KL is exp(-η·overlap)."""

    def validate(self, prefix: str | None = "model") -> DrafterConfig:
        """Checks the fields the drafter kind reads; raises ConfigError naming the option
        (`prefix.field`; the bare field name when `prefix` is None)."""
        check = Checker(self, prefix)
        check("kind", self.kind in REGISTERED, f"must be one of {' / '.join(REGISTERED)}")
        check.at_least_1("num_draft_layers")
        check("draft_vocab_size", (self.draft_vocab_size or 0) >= 0, "must be >= 0")
        parse_terms(self.loss_terms, check.name("loss_terms"))  # a ConfigError naming the term
        check("lk_eta", self.lk_eta >= 0, "must be >= 0")
        self.own_fields().check_fields(check)
        return self

    def own_fields(self) -> Any:
        """This section's kind's own fields, as that kind's dataclass (`Registration.fields`)."""
        own = REGISTERED[self.kind].fields
        return own(**{f.name: getattr(self, f.name) for f in fields(own)})

    def kind_fields(self) -> tuple[str, ...]:
        """The fields this section's kind reads: the common ones and its own."""
        by_kinds = {f.name for r in REGISTERED.values() for f in fields(r.fields)}
        own = {f.name for f in fields(REGISTERED[self.kind].fields)}
        return tuple(f.name for f in fields(self) if f.name in own or f.name not in by_kinds)


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
        k: getattr(cfg, k)
        for k in cfg.kind_fields()
        if k not in ("mask_token_id", "init_from", "draft_vocab_size")
    }


def sized(name: str, block: Any) -> DrafterConfig:
    """The preset `name` sized to a small target by its kind's size block
    (`DrafterSizes.block(name)`): the block's sizes over the preset's; a None size keeps the
    preset's."""
    overrides = _known(name).sized(block)
    return preset(name, **{k: v for k, v in overrides.items() if v is not None})


# ---- the sizes that shrink the presets to a small target ---------------------------------------
def with_kind_sizes(base: type) -> type:
    """`base` (a dataclass of methods) with one field per registered kind, named as the kind: its
    size block (`Registration.sizes`, with its defaults), in the registry's order."""
    specs = [
        (r.name, r.sizes, field(default_factory=r.sizes), inspect.cleandoc(r.sizes.__doc__ or ""))
        for r in REGISTERED.values()
    ]
    return made_dataclass(base, specs)


@with_kind_sizes
@dataclass
class DrafterSizes:
    """The sizes that shrink the presets to a small target (the demo's `drafter` section, the
    bench's `sizes`): one block per kind (`--drafter.<kind>.<size>`), its presets sized by it
    (`sized`; listed under Attributes)."""

    def block(self, name: str) -> Any:
        """The size block of the preset `name`'s kind."""
        _known(name)
        return getattr(self, _PRESET_KIND[name])

    def validate(self, prefix: str) -> None:
        """Every size is a count >= 1, or None where its type allows it (the preset's own); a
        ConfigError names `<prefix>.<kind>.<size>`."""
        for kind in REGISTERED:
            block = getattr(self, kind)
            check = Checker(block, f"{prefix}.{kind}")
            for f in fields(block):
                if getattr(block, f.name) is not None:
                    check.at_least_1(f.name)

    @classmethod
    def with_block(cls, name: str, **sizes: int | None) -> DrafterSizes:
        """The default blocks, the preset `name`'s kind's given `sizes`."""
        _known(name)
        kind = _PRESET_KIND[name]
        own = REGISTERED[kind].sizes
        unknown = sorted(set(sizes) - {f.name for f in fields(own)})
        if unknown:
            raise ConfigError(
                f"sizes.{kind}: no {unknown[0]} (its sizes: {[f.name for f in fields(own)]})"
            )
        return cls(**{kind: own(**sizes)})

    @classmethod
    def for_demo(cls) -> DrafterSizes:
        """Every kind's block with its `Registration.demo_sizes` over the defaults: the demo's
        drafters (docs/study.md)."""
        return cls(**{kind: r.sizes(**r.demo_sizes) for kind, r in REGISTERED.items()})

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> DrafterSizes:
        """From `dataclasses.asdict` of one (how the bench hands its config to a variant's
        process)."""
        return cls(**{kind: REGISTERED[kind].sizes(**block) for kind, block in data.items()})
