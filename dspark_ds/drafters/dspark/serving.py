"""The engine formats of DSpark / DFlash drafters (drafters/serving.py, docs/serving.md).

- DSpark (a Markov or confidence head), and DFlash in the anchor layout
  (`sample_from_anchor`): DeepSpec's directory (`Qwen3DSparkModel`, `Gemma4DSparkModel`), which
  vLLM's `dspark` method reads, in its V2 model runner only, with a vanilla Markov head (vLLM's
  loader finds no place for a gated or GRU head's weights, and misses the Markov weights of a
  rank-0 drafter: no engine serves DFlash in the anchor layout).
- DFlash (no heads) in the fill-in layout on the Qwen3 backbone: the DFlash directory
  (`DFlashDraftModel`: `dflash_config.mask_token_id` / `target_layer_ids`, `block_size` = the
  anchor + γ masks), which vLLM's and SGLang's `dflash` methods read (vLLM's CPU build too).

`native_dict` also reads published DFlash checkpoints (z-lab's `*-DFlash-b16`, which leave
their embedding and lm_head to the target's).
"""

from __future__ import annotations

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError

DFLASH = "DFlashDraftModel"
ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")
READS = (*ARCHITECTURES, DFLASH)
# the heads' fields of our config; a DFlash directory has none
_HEAD_FIELDS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
)


def _is_dflash(data: dict) -> bool:
    """A Qwen3 DFlash drafter in the fill-in layout: what the engines' DFlash path serves."""
    return (
        data["architectures"][0] == "Qwen3DSparkModel"
        and int(data.get("markov_rank") or 0) == 0
        and not data.get("enable_confidence_head", False)
        and not data.get("sample_from_anchor", True)
    )


def engine_dict(data: dict) -> dict:
    if not _is_dflash(data):
        return data
    out = {k: v for k, v in data.items() if k not in _HEAD_FIELDS}
    out["architectures"] = [DFLASH]
    # NOTE: a DFlash block counts the anchor: γ drafts are a block of γ + 1 (SGLang reads it)
    out["block_size"] = int(data["block_size"]) + 1
    out["dflash_config"] = {
        "mask_token_id": int(data["mask_token_id"]),
        "target_layer_ids": [int(i) for i in data["target_layer_ids"]],
    }
    return out


def native_dict(data: dict, target_config=None) -> dict:
    if data["architectures"][0] != DFLASH:
        return data
    dflash = data.get("dflash_config") or {}
    out = {k: v for k, v in data.items() if k != "dflash_config"}
    for name in ("mask_token_id", "target_layer_ids"):
        value = dflash.get(name, data.get(name))
        if value is None:
            raise ConfigError(f"dflash_config.{name}: missing from the DFlash config.json")
        out[name] = value
    if "block_size" not in data:
        raise ConfigError("block_size: missing from the DFlash config.json")
    if data.get("layer_types") and any(t != "full_attention" for t in data["layer_types"]):
        raise ConfigError(
            f"layer_types: {sorted(set(data['layer_types']))}; dspark-ds DFlash drafters have "
            "full-attention layers only"
        )
    out["architectures"] = ["Qwen3DSparkModel"]
    out["block_size"] = int(data["block_size"]) - 1
    out["sample_from_anchor"] = False
    out["markov_rank"] = 0
    out["enable_confidence_head"] = False
    out["confidence_head_with_markov"] = False
    out.setdefault("num_anchors", 512)  # training's own setting; the run's model section decides
    if "num_target_layers" not in out and target_config is not None:
        out["num_target_layers"] = int(text_config(target_config).num_hidden_layers)
    return out


def serving_format(data: dict) -> dict:
    gamma = int(data["block_size"])
    if _is_dflash(data):
        return dict(
            name="DFlash",
            architecture=DFLASH,
            vllm_method="dflash",
            num_speculative_tokens=gamma,
            sglang_algorithm="DFLASH",
        )
    rank = int(data.get("markov_rank") or 0)
    head = data.get("markov_head_type", "vanilla")
    why = None
    if rank == 0:  # vLLM's loader then misses markov_head.markov_w1 / markov_w2
        why = "markov_rank: 0; vLLM's dspark method needs a Markov head, and " + (
            "the engines' DFlash path the fill-in layout: train DFlash with sample_from_anchor "
            "false to serve it"
            if data.get("sample_from_anchor", True)
            else f"their DFlash path the Qwen3 backbone, not {data['architectures'][0]}"
        )
    elif head != "vanilla":  # vLLM's loader has no place for the gate / GRU weights
        why = f"markov_head_type: vLLM's DSpark has the vanilla Markov head, not {head!r}"
    elif data.get("draft_vocab_size"):  # its head and Markov W2 are vocabulary-sized
        why = (
            f"draft_vocab_size: {data['draft_vocab_size']}; vLLM's dspark method has no draft "
            "vocabulary map (d2t), its DFlash and Eagle3 methods do"
        )
    return dict(
        name="DeepSpec DSpark",
        architecture=data["architectures"][0],
        vllm_method=None if why else "dspark",
        num_speculative_tokens=gamma,
        vllm_v2_runner=True,
        warnings=[why] if why else [],
    )


def parity_suspects(data: dict) -> list[str]:
    """What makes a DSpark / DFlash drafter accept less in an engine than in our evaluation."""
    layout = "anchor" if data.get("sample_from_anchor", True) else "fill-in"
    method = serving_format(data)["vllm_method"]
    return [
        f"the block layout: trained in the {layout} layout (sample_from_anchor "
        f"{str(data.get('sample_from_anchor', True)).lower()}); the server must run vLLM's "
        f"{method!r} method on this directory as written",
        f"the tapped layers: target_layer_ids {list(data['target_layer_ids'])} (vLLM reads "
        "them as its aux layers + 1)",
        f"the mask token: mask_token_id {data['mask_token_id']} and the target's embedding of it",
    ]
