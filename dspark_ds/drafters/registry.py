"""The drafter kinds: one `Registration` per kind (drafters/common/registration.py), each from its
folder's config.py. Adding a kind is its folder and one entry in `REGISTERED`; the `model`
section, the presets, the backends and the engine formats are built from this list, and what
each kind can do is read from it (`REGISTERED[name].capabilities`, plain data).

get_kind(cfg.model.kind)     # the kind's `DrafterKind` (drafters/kind.py), by `model.kind`
kind_of(drafter)             # of a built or loaded drafter (a DeepSpeed engine's `.module`)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dspark_ds.drafters.common.registration import Registration
from dspark_ds.drafters.dspark import config as dspark
from dspark_ds.drafters.eagle3 import config as eagle3
from dspark_ds.errors import ConfigError

if TYPE_CHECKING:  # NOTE: a kind's module imports the `model` section, which imports this one
    from dspark_ds.drafters.kind import DrafterKind

REGISTERED: dict[str, Registration] = {
    r.name: r for r in (dspark.REGISTRATION, eagle3.REGISTRATION)
}
"""model.kind -> its registration; the first is the default kind."""


class _Kinds(Mapping):
    """model.kind -> the kind's `DrafterKind` instance, its module imported on first access."""

    def __init__(self):
        self._made: dict[str, Any] = {}

    def __getitem__(self, name: str) -> DrafterKind:
        if name not in self._made:
            module, _, cls = REGISTERED[name].kind_class.partition(":")
            self._made[name] = getattr(importlib.import_module(module), cls)()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTERED)

    def __len__(self) -> int:
        return len(REGISTERED)


KINDS: Mapping[str, DrafterKind] = _Kinds()


def get_kind(name: str) -> DrafterKind:
    if name not in REGISTERED:
        raise ConfigError(f"model.kind: unknown drafter kind {name!r}; choose from {list(KINDS)}")
    return KINDS[name]


def kind_of(model: Any) -> DrafterKind:
    """The kind of a drafter, by its backend's architecture (a DeepSpeed / DDP wrapper's
    `.module` is looked through)."""
    drafter = getattr(model, "module", model)
    architecture = getattr(type(drafter), "architecture", None)
    for r in REGISTERED.values():
        if architecture in r.backends:
            return KINDS[r.name]
    raise ValueError(f"drafter: {type(drafter).__name__} is not a drafter of a known kind")
