"""The drafter kinds by name: one `DrafterKind` instance each (drafters/kind.py).

get_kind(cfg.model.kind)     # by the run's `model.kind`
kind_of(drafter)             # of a built or loaded drafter (a DeepSpeed engine's `.module`)
"""

from __future__ import annotations

from torch import nn

from dspark_ds.drafters.dspark.kind import DSpark
from dspark_ds.drafters.eagle3.kind import Eagle3
from dspark_ds.drafters.kind import DrafterKind, bare
from dspark_ds.errors import ConfigError

KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in (DSpark(), Eagle3())}


def get_kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ConfigError(f"model.kind: unknown drafter kind {name!r}; choose from {list(KINDS)}")
    return KINDS[name]


def kind_of(model: nn.Module) -> DrafterKind:
    """The kind of a drafter (a DeepSpeed / DDP wrapper's `.module` is looked through)."""
    for kind in KINDS.values():
        if isinstance(bare(model), kind.model_class):
            return kind
    raise ValueError(f"drafter: {type(bare(model)).__name__} is not a drafter of a known kind")
