"""Data pipeline: chat jsonl → tokens + loss masks → (regenerated answers) → target features.

Entry points (one per subcommand): ``prepare``, ``regenerate``, ``build_cache``,
``estimate_cache``; the trainer uses ``build_train_loader`` and ``DataConfig``.
"""

from dspark_ds.data.config import (
    BuildCacheConfig,
    DataConfig,
    EstimateCacheConfig,
    PrepareConfig,
    RegenerateConfig,
)

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


def __getattr__(name):  # lazy: importing the configs must not load transformers
    if name in ("build_cache", "estimate_cache"):
        from dspark_ds.data import cache_writer

        return getattr(cache_writer, name)
    if name == "build_train_loader":
        from dspark_ds.data.loader import build_train_loader

        return build_train_loader
    if name == "prepare":
        from dspark_ds.data.tokens import prepare

        return prepare
    if name == "regenerate":
        from dspark_ds.data.regeneration import regenerate

        return regenerate
    raise AttributeError(name)
