"""What a drafter kind declares to the registry (drafters/registry.py) before any of its code is
imported: its `model` fields, its presets and the size block that shrinks them, its backends,
its serving formats, and where its `DrafterKind` class is.

Each kind's folder holds one `Registration` (`drafters/<kind>/config.py`, next to its fields);
the registry lists them, and the `model` section (`DrafterConfig`, drafters/presets.py), the
presets, the backends (drafters/io.py) and the engine formats (drafters/serving.py) are built
from that list. The kind's class is imported by path on first use (`get_kind`), since its
module needs the `model` section these modules build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any


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
    """One of the paper's drafters: its kind's `model` section with `fields` set."""

    label: str
    """How reports name it."""
    fields: Mapping[str, Any]
    """The `model` fields it sets over the defaults (the paper's sizes)."""
    sized: Callable[[Any], dict[str, Any]]
    """The `model` fields that size it to a small target, from its kind's size block
    (`Registration.sizes`: the demo's and the bench's); a None value keeps the preset's."""
    claims: tuple[Claim, ...] = ()


# the transformers config classes of the two backbones every kind's backends build on
# (`Registration.backends`' third field)
QWEN3_CONFIG = "transformers.models.qwen3.configuration_qwen3:Qwen3Config"
GEMMA4_CONFIG = "transformers.models.gemma4.configuration_gemma4:Gemma4TextConfig"


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
