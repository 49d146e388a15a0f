"""The DSpark / DFlash drafter's transformers config for a target: the target's text config
(drafters/io.py `draft_config_from_target`) with the `model` section's DSpark fields
(docs/algorithm.md#the-drafter, docs/checkpoint-format.md)."""

from __future__ import annotations

from dspark_ds.drafters.io import draft_config_from_target, finalize_draft_config
from dspark_ds.drafters.presets import DrafterConfig, preset
from dspark_ds.errors import ConfigError


def dspark_config(
    target_config, model: DrafterConfig, *, target_layer_ids: list[int], mask_token_id: int
):
    """The DSpark / DFlash drafter config of `model` (a validated "dspark" section) for this
    target (docs/algorithm.md#the-drafter). Raises ConfigError naming the offending field."""
    cfg, text = draft_config_from_target(
        target_config, "dspark", target_layer_ids, model.num_draft_layers, model.backbone
    )
    vocab = int(text.vocab_size)
    if not 0 <= int(mask_token_id) < vocab:
        raise ConfigError(f"mask_token_id: must be in [0, {vocab}), got {mask_token_id!r}")
    enable_confidence = model.confidence_head_alpha > 0
    cfg.block_size = int(model.block_size)
    cfg.sample_from_anchor = bool(model.sample_from_anchor)
    cfg.mask_token_id = int(mask_token_id)
    cfg.num_anchors = int(model.num_anchors)
    cfg.markov_rank = int(model.markov_rank)
    cfg.markov_head_type = str(model.markov_head_type)
    cfg.enable_confidence_head = enable_confidence
    cfg.confidence_head_with_markov = bool(model.confidence_head_with_markov) and enable_confidence
    return finalize_draft_config(cfg, text)


def build_draft_config(target_config, *, target_layer_ids: list[int], mask_token_id: int, **fields):
    """A DSpark / DFlash drafter config; `fields` (DrafterConfig fields) override the DSpark
    preset. Raises ConfigError naming the offending field."""
    model = preset("dspark", **fields).validate(prefix=None)
    return dspark_config(
        target_config, model, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id
    )
