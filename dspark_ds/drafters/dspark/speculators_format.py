"""DSpark / DFlash in the speculators format (drafters/speculators_format.py).

A drafter with a Markov or a confidence head is speculators' `dspark` (`DSparkDraftModel`),
one without either its `dflash` (`DFlashDraftModel`), in the drafter's block layout
(`sample_from_anchor`). speculators' `block_size` counts the block's slots: γ in the anchor
layout, γ + 1 (the anchor, then γ masks) in the fill-in layout; its greedy proposal drafts γ.
`aux_hidden_state_layer_ids` = `target_layer_ids` + 1. The directory leaves the embedding and
lm_head to the target (speculators loads them from the verifier), as DFlash checkpoints do.

Refused by name: an RNN Markov head in the fill-in layout (speculators runs its recurrence from
the anchor's slot, dspark-ds from the first draft slot: not the same head).
"""

from __future__ import annotations

from dspark_ds.drafters.common.target_config import from_speculators_ids
from dspark_ds.errors import ConfigError

ARCHITECTURES = ("Qwen3DSparkModel",)
"""Our architectures it writes (speculators' drafter layers are Qwen3's)."""
MODEL_TYPES = ("dspark", "dflash")
_BLOCK_FIELDS = ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "sample_from_anchor")
_HEAD_FIELDS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
FIELDS = {
    # sliding_window_non_causal: the mask of sliding-window layers, which are refused
    "dflash": (*_BLOCK_FIELDS, "sliding_window_non_causal"),
    "dspark": (*_BLOCK_FIELDS, "sliding_window_non_causal", *_HEAD_FIELDS),
}
SAVES_SHARED = False
"""The directory holds no embedding or lm_head (the target's)."""
_CLASSES = {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel"}
_CONFIGS = {"dspark": "DSparkSpeculatorConfig", "dflash": "DFlashSpeculatorConfig"}
# speculators' defaults for what a config.json may leave out
_DSPARK_DEFAULTS = dict(
    sample_from_anchor=True,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
)
# DFlash, DSpark's special case: no Markov head, no confidence head, no sample from the anchor
_DFLASH_OFF = ("sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov")
_DEFAULTS = {
    "dspark": _DSPARK_DEFAULTS,
    "dflash": {**_DSPARK_DEFAULTS, **dict.fromkeys(_DFLASH_OFF, False), "markov_rank": 0},
}


def _check_rnn_layout(head: str, rank: int, anchor: bool) -> None:
    if rank > 0 and head == "rnn" and not anchor:
        raise ConfigError(
            "markov_head_type: 'rnn' in the fill-in layout (sample_from_anchor false): "
            "speculators runs the recurrence from the anchor's slot, dspark-ds from the first "
            "draft slot"
        )


def to_speculators(native: dict) -> tuple[dict, int]:
    """(the kind's fields of the speculators config.json, the draft tokens a round)."""
    anchor = bool(native.get("sample_from_anchor", True))
    rank = int(native.get("markov_rank") or 0)
    confidence = bool(native.get("enable_confidence_head", False))
    head = str(native.get("markov_head_type", "vanilla"))
    _check_rnn_layout(head, rank, anchor)
    model_type = "dspark" if rank > 0 or confidence else "dflash"
    gamma = int(native["block_size"])
    out = {
        "speculators_model_type": model_type,
        "architectures": [_CLASSES[model_type]],
        "auto_map": {"": f"config.{_CONFIGS[model_type]}"},
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in native["target_layer_ids"]],
        "block_size": gamma if anchor else gamma + 1,
        "mask_token_id": int(native["mask_token_id"]),
        "sample_from_anchor": anchor,
        # NOTE: speculators applies it to sliding-window layers only (its full-attention
        # blocks, like ours, are always bidirectional), but vLLM 0.32 reads it as
        # `dflash_config.causal = not sliding_window_non_causal` for every layer: false (the
        # speculators default) would have vLLM draft with causal blocks, not the model trained
        "sliding_window_non_causal": True,
    }
    if model_type == "dspark":
        out.update(
            markov_rank=rank,
            markov_head_type=head,
            enable_confidence_head=confidence,
            confidence_head_with_markov=confidence
            and bool(native.get("confidence_head_with_markov", False)),
        )
    return out, gamma


def from_speculators(data: dict, layer: dict, speculative_tokens: int) -> dict:
    """The kind's fields of our drafter config from a speculators `dspark` / `dflash`
    config.json dict (`layer`: its checked transformer_layer_config)."""
    model_type = data["speculators_model_type"]
    fields = {**_DEFAULTS[model_type], **{k: data[k] for k in _HEAD_FIELDS if k in data}}
    anchor = bool(data.get("sample_from_anchor", fields["sample_from_anchor"]))
    if data.get("block_size") is None or data.get("mask_token_id") is None:
        missing = "block_size" if data.get("block_size") is None else "mask_token_id"
        raise ConfigError(f"{missing}: missing from the speculators config.json")
    block = int(data["block_size"])
    gamma = block if anchor else block - 1
    if gamma < 1:
        raise ConfigError(f"block_size: {block} leaves no draft slot in the fill-in layout")
    if speculative_tokens != gamma:
        raise ConfigError(
            f"speculators_config.proposal_methods[0].speculative_tokens: {speculative_tokens}, "
            f"but a block of {block} drafts {gamma} (sample_from_anchor "
            f"{str(anchor).lower()}); dspark-ds drafts the whole block"
        )
    rank = int(fields["markov_rank"])
    _check_rnn_layout(str(fields["markov_head_type"]), rank, anchor)
    return {
        "architectures": ["Qwen3DSparkModel"],
        "target_layer_ids": from_speculators_ids(data, "aux_hidden_state_layer_ids"),
        "block_size": gamma,
        "sample_from_anchor": anchor,
        "mask_token_id": int(data["mask_token_id"]),
        "markov_rank": rank,
        "markov_head_type": str(fields["markov_head_type"]),
        "enable_confidence_head": bool(fields["enable_confidence_head"]),
        "confidence_head_with_markov": bool(fields["enable_confidence_head"])
        and bool(fields["confidence_head_with_markov"]),
        "num_anchors": 512,  # training's own setting (speculators' max_anchors is a trainer flag)
    }
