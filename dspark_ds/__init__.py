"""dspark-ds: train DSpark / DFlash speculative-decoding drafters with DeepSpeed."""

__version__ = "0.1.0"
