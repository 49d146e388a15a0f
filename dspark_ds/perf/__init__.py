"""Performance: the training step's implementation choice (`perf` config) and its benchmark."""

from dspark_ds.perf.config import LOSS_IMPLEMENTATIONS, PerfConfig

__all__ = ["LOSS_IMPLEMENTATIONS", "PerfConfig"]
