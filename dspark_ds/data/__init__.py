"""Data pipeline: chat jsonl → tokens + loss masks → (regenerated answers) → target features.

Entry points (one per subcommand): ``prepare``, ``regenerate``, ``build_cache``,
``estimate_cache``; the trainer uses ``build_train_loader`` and ``DataConfig``.
"""

from dspark_ds.data.cache_writer import build_cache, estimate_cache
from dspark_ds.data.config import (
    BuildCacheConfig,
    DataConfig,
    EstimateCacheConfig,
    PrepareConfig,
    RegenerateConfig,
)
from dspark_ds.data.regeneration import regenerate
from dspark_ds.data.tokens import prepare

__all__ = [
    "BuildCacheConfig",
    "DataConfig",
    "EstimateCacheConfig",
    "PrepareConfig",
    "RegenerateConfig",
    "build_cache",
    "build_train_loader",
    "estimate_cache",
    "prepare",
    "regenerate",
]


def __getattr__(name):
    if name == "build_train_loader":
        # lazy: the served client's aiohttp, 0.1 s at every subcommand's --help (docs/testing.md)
        from dspark_ds.data.loader import build_train_loader

        return build_train_loader
    raise AttributeError(name)
