"""What a drafter reads from its target's config: the text config and the tapped layer ids."""

from __future__ import annotations

from dspark_ds.errors import ConfigError


def text_config(config):
    """The text sub-config of a (possibly multimodal, e.g. Gemma4) Hugging Face config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def global_attr(config, name: str, default=None):
    """`config.name` (or `default` when absent or None) for a field that newer transformers
    releases (5.2x) mark per-layer on heterogeneous configs such as Gemma4's, where a plain
    read raises AmbiguousGlobalPerLayerAttributeError: the config's own global value."""
    try:
        value = getattr(config, name, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        value = config.__dict__.get(name)
    return default if value is None else value


def validate_layer_ids(layer_ids, num_layers: int, field: str = "target_layer_ids") -> list[int]:
    """The ids as ints, or ConfigError naming `field`: not empty, strictly increasing, each -1
    (the embedding output) or a decoder layer in [0, L-1] (docs/algorithm.md#target-features)."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ConfigError(f"{field}: must not be empty")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"{field}: must be strictly increasing, got {ids}")
    if ids[0] < -1 or ids[-1] > num_layers - 1:
        raise ConfigError(
            f"{field}: {ids} out of range: ids must lie in -1..{num_layers - 1} (the target has "
            f"{num_layers} decoder layers; -1 = the embedding output)"
        )
    return ids


def from_speculators_ids(data: dict, field: str) -> list[int]:
    """Our `target_layer_ids` from a speculators checkpoint's field of tapped layers
    (drafters/speculators_format.py): speculators counts the embedding output as layer 0 (its id
    i is the input of decoder layer i), so ours is theirs - 1. ConfigError naming `field` when
    it is missing or not strictly increasing."""
    ids = data.get(field)
    if not ids:
        raise ConfigError(f"{field}: missing from the speculators config.json")
    ids = [int(i) for i in ids]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ConfigError(
            f"{field}: {ids}; dspark-ds reads the tapped layers in increasing order only"
        )
    return [i - 1 for i in ids]
