"""The Eagle3 drafter's transformers config for a target: the target's text config
(drafters/io.py `draft_config_from_target`) with the `model` section's Eagle3 fields, as the
reference's `Qwen3Eagle3Model` reads them (docs/checkpoint-format.md)."""

from __future__ import annotations

from dspark_ds.drafters.io import draft_config_from_target, finalize_draft_config
from dspark_ds.drafters.presets import DrafterConfig, preset


def eagle3_config(
    target_config,
    model: DrafterConfig,
    *,
    target_layer_ids: list[int],
    target_model_name_or_path: str | None = None,
):
    """The Eagle3 baseline's drafter config of `model` (a validated "eagle3" section): the
    reference's `Qwen3Eagle3Model` fields (`target_layer_ids`, `ttt_length`, `step_loss_decay`,
    `draft_num_hidden_layers`, `num_target_layers`). Raises ConfigError naming the field."""
    cfg, text = draft_config_from_target(
        target_config,
        "eagle3",
        target_layer_ids,
        model.num_draft_layers,
        draft_vocab_size=model.draft_vocab_size,
    )
    cfg.draft_num_hidden_layers = int(model.num_draft_layers)
    cfg.ttt_length = int(model.ttt_length)
    cfg.step_loss_decay = float(model.step_loss_decay)
    if target_model_name_or_path is not None:
        cfg.target_model_name_or_path = str(target_model_name_or_path)
    return finalize_draft_config(cfg, text)


def build_eagle3_config(
    target_config,
    *,
    target_layer_ids: list[int],
    target_model_name_or_path: str | None = None,
    **fields,
):
    """An Eagle3 drafter config; `fields` (num_draft_layers, ttt_length, step_loss_decay)
    override the Eagle3 preset. Raises ConfigError naming the offending field."""
    model = preset("eagle3", **fields).validate(prefix=None)
    return eagle3_config(
        target_config,
        model,
        target_layer_ids=target_layer_ids,
        target_model_name_or_path=target_model_name_or_path,
    )
