"""What a drafter kind declares to the registry (drafters/registry.py) before any of its code is
imported: its `model` fields, its presets and the size block that shrinks them, its backends,
its serving formats, its speculators format, what it can do (`Capabilities`, plain data) and
where its `DrafterKind` class is.

Each kind's folder holds one `Registration` (`drafters/<kind>/config.py`, next to its fields:
drafters/presets.py `with_kind_fields` appends them to the common ones, so a recipe stays one
flat `model:` mapping while the fields, their documentation and their checks live with the kind
that reads them); the registry lists them, and the `model` section (`DrafterConfig`, drafters/presets.py), the
presets, the backends (drafters/io.py) and the engine formats (drafters/serving.py) are built
from that list. The kind's class is imported by path on first use (`get_kind`), since its
module needs the `model` section these modules build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal


@dataclass(frozen=True)
class Claim:
    """The paper's claim of a preset against another one: `metric` (tau | speedup |
    acceptance, the last at every position: the smallest ratio over them) of this preset over
    `over`'s at `temperature` is at least `at_least`, in every seed."""

    metric: str
    over: str
    temperature: float
    at_least: float
    first_position_note: str = ""
    """An acceptance claim's one line under a miss at the first position only (what it means)."""


@dataclass(frozen=True)
class Preset:
    """One of the paper's drafters: its kind's `model` section with `fields` set."""

    label: str
    """How reports name it."""
    fields: Mapping[str, Any]
    """The `model` fields it sets over the defaults (the paper's sizes)."""
    sized: Callable[[Any], dict[str, Any]]
    """The `model` fields that size it to a small target, from its kind's size block
    (`Registration.sizes`: the demo's and the bench's); a None value keeps the preset's."""
    claims: tuple[Claim, ...] = ()
    speculators_loss: Mapping[str, Any] = field(default_factory=dict)
    """The `model` fields that give it the loss speculators 0.9 trains its kind with, over
    `fields` (docs/peers.md; the demo's `--loss speculators`); {} = the same as its own."""
    demo_loss: Mapping[str, Any] = field(default_factory=dict)
    """The `model` fields the demo trains it with by default (`--loss measured`), over `fields`:
    the loss it drafted best with in docs/demo.md's and docs/peers.md's measurements (its own,
    speculators', or their terms mixed); {} = its own."""
    demo_data: Mapping[str, Any] = field(default_factory=dict)
    """The `data` fields the demo trains it with beside `demo_loss` (`--loss measured`): the
    order of the sequences it drafted best in (docs/peers.md); {} = the data section's."""
    demo_train: Mapping[str, Any] = field(default_factory=dict)
    """The `train` fields the demo trains it with beside `demo_loss` (`--loss measured`): the
    optimizer settings it drafted best with (docs/peers.md#muons-momentum); {} = the budget's."""


# the optional heads a kind's drafters can have (`Capabilities.heads`)
MARKOV_HEAD = "markov"
CONFIDENCE_HEAD = "confidence"


@dataclass(frozen=True)
class Capabilities:
    """What a kind can do, declared as data: the trainer, the tuner, evaluation, the bench and
    the demo read these fields (`get_kind(name).capabilities`); none of them probes a drafter
    for an attribute. What one built drafter has (its confidence head, the tokens it drafts a
    round) its kind answers from the drafter's config (`DrafterKind.decode`)."""

    label: str
    """How reports name the kind ("DSpark / DFlash")."""
    drafting: Literal["parallel", "unrolled"]
    """How a decoding round drafts: "parallel", a block of tokens from one forward; "unrolled",
    one forward per drafted token, each fed the previous one."""
    uses_mask_token: bool
    """Its drafter config needs the MASK token id (the slots of a block after its anchor)."""
    anchor_blocks: bool
    """It trains on `model.num_anchors` blocks sampled per sequence (the block-shape warnings,
    the sampler statistics and the demo's anchor count apply); otherwise on every position."""
    heads: tuple[str, ...]
    """The optional heads its drafters can have (`MARKOV_HEAD`, `CONFIDENCE_HEAD`)."""
    block_layouts: tuple[str, ...]
    """The layouts of a drafted block it trains in (docs/serving.md#the-block-layout:
    "anchor", "fill-in"); () when it drafts no blocks."""
    loss_impls: tuple[str, ...]
    """perf.loss_impl values it honours."""
    attn_impls: tuple[str, ...]
    """perf.attn_implementation values it honours."""
    bench_variants: tuple[str, ...]
    """What `dspark-ds bench` runs by default: "<attention>/<loss>" paths, the first its
    reference (the straight-line path the others are compared with)."""


# the transformers config classes of the two backbones every kind's backends build on
# (`Registration.backends`' third field)
QWEN3_CONFIG = "transformers.models.qwen3.configuration_qwen3:Qwen3Config"
GEMMA4_CONFIG = "transformers.models.gemma4.configuration_gemma4:Gemma4TextConfig"
DEEPSEEK_V4_CONFIG = "transformers.models.deepseek_v4.configuration_deepseek_v4:DeepseekV4Config"


def on_backbones(package: str, model_suffix: str) -> dict[str, Any]:
    """`Registration.backends`, `architectures` and `generic_architecture` of a kind whose
    backends are built on the two backbones: `Qwen3<model_suffix>` in `<package>.qwen3` (also
    the generic architecture, for a target of any other family) and `Gemma4<model_suffix>` in
    `<package>.gemma4`."""
    qwen3, gemma4 = f"Qwen3{model_suffix}", f"Gemma4{model_suffix}"
    return {
        "backends": {
            qwen3: (f"{package}.qwen3", qwen3, QWEN3_CONFIG),
            gemma4: (f"{package}.gemma4", gemma4, GEMMA4_CONFIG),
        },
        "architectures": {"qwen3": qwen3, "gemma4": gemma4, "gemma4_text": gemma4},
        "generic_architecture": qwen3,
    }


@dataclass(frozen=True)
class Registration:
    """One drafter kind, as the registry holds it."""

    name: str
    """The `model.kind` value."""
    fields: type
    """Its `model` fields (a dataclass with `check_fields(self, check)`), which `DrafterConfig`
    appends to the common ones (drafters/presets.py `with_kind_fields`)."""
    kind_class: str
    """"module:Class" of its `DrafterKind` (imported by `get_kind`)."""
    presets: Mapping[str, Preset]
    """Its presets by name (the first is the kind's default drafter)."""
    sizes: type
    """Its size block: a dataclass of the sizes that shrink its presets to a small target (each a
    count >= 1, or None for the preset's own), with `draft_length` (γ: tokens drafted per round).
    The demo's `drafter` section and the bench's `sizes` hold one per kind
    (drafters/presets.py `DrafterSizes`); `Preset.sized` reads it."""
    backends: Mapping[str, tuple[str, str, str]]
    """Architecture -> (module, class, transformers config class path) of each backend."""
    architectures: Mapping[str, str]
    """Target text model_type -> architecture, for the families with a backbone of their own."""
    generic_architecture: str
    """The Qwen3-style architecture built for a target of any other family."""
    serving: ModuleType
    """Its engine formats (ARCHITECTURES, READS, engine_dict, native_dict, serving_format:
    drafters/serving.py)."""
    capabilities: Capabilities
    """What it can do (how it drafts, its heads, the perf paths it honours, its bench
    variants)."""
    speculators: ModuleType | None = None
    """Its side of the speculators checkpoint format (ARCHITECTURES, MODEL_TYPES, FIELDS,
    SAVES_SHARED, to_speculators, from_speculators: drafters/speculators_format.py); None: it has none."""
    target_backbones: Mapping[str, str] = field(default_factory=dict)
    """Target text model_type -> architecture built with `model.backbone: target` (the target
    family's own decoder layers), for the families that have one beyond `architectures`."""
    demo_sizes: Mapping[str, Any] = field(default_factory=dict)
    """The sizes the demo sets over its size block's defaults (`DrafterSizes.for_demo`; the
    bench keeps the defaults); {} = the defaults."""
