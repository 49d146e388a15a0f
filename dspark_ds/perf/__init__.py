"""Performance: the chunked loss, the training-step entry point and the benchmark."""

from .chunked_loss import DEFAULT_CHUNK_ANCHORS, chunked_dspark_loss, recompute_dspark_loss
from .config import LOSS_IMPLEMENTATIONS, PerfConfig
from .step import apply_perf_config, forward_and_loss, resolve_loss_impl

__all__ = [
    "DEFAULT_CHUNK_ANCHORS",
    "LOSS_IMPLEMENTATIONS",
    "PerfConfig",
    "apply_perf_config",
    "chunked_dspark_loss",
    "forward_and_loss",
    "recompute_dspark_loss",
    "resolve_loss_impl",
]
