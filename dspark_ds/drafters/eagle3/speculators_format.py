"""Eagle3 in the speculators format (drafters/speculators_format.py): speculators' `eagle3`
(`Eagle3DraftModel`).

A one-layer Qwen3 Eagle3 drafter maps one to one: `eagle_aux_hidden_state_layer_ids` =
`target_layer_ids` + 1, the greedy proposal drafts `ttt_length` tokens, and the directory holds
the embedding and lm_head (speculators saves them). speculators' Eagle3 feeds the 2H-wide
[embedding ; hidden] input to its first layer only (the others are plain decoder layers), so a
drafter of several layers has no counterpart either way.

Refused by name: `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` (other
Eagle3 layers than the one dspark-ds trains) and `embed_requires_grad` (a trained embedding:
dspark-ds drafters share the target's).
"""

from __future__ import annotations

from dspark_ds.drafters.common.target_config import from_speculators_ids
from dspark_ds.errors import ConfigError

ARCHITECTURES = ("Qwen3Eagle3Model",)
"""Our architectures it writes (speculators' drafter layers are Qwen3's)."""
MODEL_TYPES = ("eagle3",)
# each a variant of the Eagle3 layer, or of its training, that dspark-ds does not have
_VARIANTS = (
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
)
FIELDS = {"eagle3": ("eagle_aux_hidden_state_layer_ids", *_VARIANTS)}
SAVES_SHARED = True
"""The directory holds the embedding and lm_head."""
_STEP_LOSS_DECAY = 0.8  # training's own setting (speculators' ttt_step_loss_decay is a flag)


def _one_layer(num_layers: int) -> None:
    if num_layers != 1:
        raise ConfigError(
            f"num_hidden_layers: {num_layers}; speculators' Eagle3 feeds the [embedding ; "
            "hidden] input to its first layer only, dspark-ds to every layer: only a one-layer "
            "Eagle3 is the same drafter in both"
        )


def to_speculators(native: dict) -> tuple[dict, int]:
    """(the kind's fields of the speculators config.json, the draft tokens a round)."""
    _one_layer(int(native["num_hidden_layers"]))
    out = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in native["target_layer_ids"]],
        **{name: False for name in _VARIANTS},
    }
    return out, int(native["ttt_length"])


def from_speculators(data: dict, layer: dict, speculative_tokens: int) -> dict:
    """The kind's fields of our drafter config from a speculators `eagle3` config.json dict
    (`layer`: its checked transformer_layer_config)."""
    for name in _VARIANTS:
        if data.get(name):
            raise ConfigError(
                f"{name}: true; dspark-ds trains the Eagle3 layer without it (and shares the "
                "target's frozen embedding)"
            )
    _one_layer(int(layer["num_hidden_layers"]))
    return {
        "architectures": ["Qwen3Eagle3Model"],
        "target_layer_ids": from_speculators_ids(data, "eagle_aux_hidden_state_layer_ids"),
        "ttt_length": int(speculative_tokens),
        "step_loss_decay": _STEP_LOSS_DECAY,
        "draft_num_hidden_layers": 1,
    }
