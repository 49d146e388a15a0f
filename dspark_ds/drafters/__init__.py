"""The drafters (DSpark / DFlash, Eagle3): pure torch + transformers (no deepspeed, mlflow or
distributed in the architecture files). `kind.py` is what every kind provides (`DrafterKind`),
`registry.py` holds one of each, `presets.py` their settings, `perf.py` the `perf` section."""

from dspark_ds.drafters.common.blocks import (
    DraftKVCache,
    DSparkForwardOutput,
    sample_anchor_positions,
)
from dspark_ds.drafters.dspark.model import DSparkDraftModel
from dspark_ds.drafters.io import (
    build_draft_config,
    build_draft_model,
    load_draft_model,
    register_auto_classes,
    save_draft_model,
)

DSparkDraftModel.from_config = staticmethod(build_draft_model)
# AutoModelForCausalLM.from_pretrained(drafter_dir) -> the drafter (see drafters/io.py)
register_auto_classes()

__all__ = [
    "DSparkDraftModel",
    "DSparkForwardOutput",
    "DraftKVCache",
    "build_draft_config",
    "build_draft_model",
    "load_draft_model",
    "sample_anchor_positions",
    "save_draft_model",
]
