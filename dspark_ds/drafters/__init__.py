"""The drafters: pure torch + transformers (no deepspeed, mlflow or distributed in the
architecture files). `kind.py` is what every kind provides (`DrafterKind`), `registry.py` holds
one of each, `presets.py` their settings, `perf.py` the `perf` section.

Importing this package changes nothing outside it: transformers' Auto classes learn the drafter
architectures only when `register_auto_classes()` is called (drafters/io.py); the package itself
loads drafters with `load_draft_model` and never needs it."""

from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.drafters.dspark.blocks import (
    DSparkForwardOutput,
    build_anchor_candidate_mask,
    sample_anchor_positions,
)
from dspark_ds.drafters.dspark.build import build_draft_config
from dspark_ds.drafters.dspark.model import DSparkDraftModel
from dspark_ds.drafters.io import (
    build_draft_model,
    load_draft_model,
    register_auto_classes,
    save_draft_model,
)

__all__ = [
    "DSparkDraftModel",
    "DSparkForwardOutput",
    "DraftKVCache",
    "build_anchor_candidate_mask",
    "build_draft_config",
    "build_draft_model",
    "load_draft_model",
    "register_auto_classes",
    "sample_anchor_positions",
    "save_draft_model",
]
