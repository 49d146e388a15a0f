"""The engine formats of DSpark / DFlash drafters (drafters/serving.py, docs/serving.md).

- DSpark (a Markov or confidence head), and DFlash in the anchor layout
  (`sample_from_anchor`): DeepSpec's directory (`Qwen3DSparkModel`, `Gemma4DSparkModel`), which
  vLLM's `dspark` method reads, in its V2 model runner only, with a vanilla Markov head (vLLM's
  loader finds no place for a gated or GRU head's weights, and misses the Markov weights of a
  rank-0 drafter: no engine serves DFlash in the anchor layout).
- DFlash (no heads) in the fill-in layout on the Qwen3 backbone: the DFlash directory
  (`DFlashDraftModel`: `dflash_config.mask_token_id` / `target_layer_ids`, `block_size` = the
  anchor + γ masks), which vLLM's and SGLang's `dflash` methods read (vLLM's CPU build too).

- DSpark on DeepSeek-V4's own layers (`model.backbone: target`, drafters/dspark/deepseek_v4.py):
  the directory vLLM's and SGLang's V4 DSpark read, laid out as DeepSeek's own checkpoints are
  (`architectures` `DeepseekV4ForCausalLM`; our backend's name is vLLM's `DSparkDraftModel`):
  the target's config with the draft layers counted apart (`num_hidden_layers` the target's,
  `n_mtp_layers` the drafter's, vLLM numbering them after the target's), `dspark_target_layer_ids`,
  `dspark_markov_rank`, `dspark_block_size`, DeepSeek's own field names beside transformers'
  (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`), and the weights under `mtp.{i}.*`
  (drafters/common/deepseek_v4.py).

`native_dict` also reads published DFlash checkpoints (z-lab's `*-DFlash-b16`, which leave
their embedding and lm_head to the target's).
"""

from __future__ import annotations

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError

DFLASH = "DFlashDraftModel"
V4 = "DSparkDraftModel"
# NOTE: what a V4 directory's config.json says. SGLang takes a draft for DeepSeek-V4 only under
# this name (its DSpark worker and attention backend ask `is_deepseek_v4`, then its loader maps
# the name to `DeepseekV4ForCausalLMDSpark`; `DSparkDraftModel` is its dense Qwen3-style
# drafter); vLLM's `dspark` method renames any deepseek_v4 draft to its `DSparkDraftModel`
V4_ENGINE = "DeepseekV4ForCausalLM"
ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel", V4)
READS = (*ARCHITECTURES, DFLASH, V4_ENGINE, "DeepseekV4ForCausalLMDSpark")
# DeepSeek's config names of the V4 attention types (its `compress_ratios`: 0 = sliding only)
_V4_ATTENTION = ("compressed_sparse_attention", "heavily_compressed_attention")
# transformers' fields vLLM's V4 layout writes DeepSeek's way (compress_ratios, num_hash_layers,
# rope_theta / compress_rope_theta / rope_scaling; the drafter's own from the draft layer count)
_V4_TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "rope_parameters")
# what only the engines' V4 layout has; our config holds them under its own names
_V4_ENGINE_ONLY = (
    "n_mtp_layers",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_block_size",
    "compress_ratios",
    "num_hash_layers",
    "qk_rope_head_dim",
    "norm_topk_prob",
)
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


def _v4_engine_dict(data: dict) -> dict:
    """Ours -> vLLM's V4 DSpark config (the target's, with the draft layers apart)."""
    # NOTE: vLLM reads DeepSeek's own config names; transformers' per-layer lists (whose
    # values the transformers vLLM pins refuses) and nested RoPE are written DeepSeek's way
    out = {k: v for k, v in data.items() if k not in _V4_TRANSFORMERS_ONLY}
    target_types = list(data["target_layer_types"])
    rates = data.get("compress_rates") or {}
    rope = data.get("rope_parameters") or {}
    compress = rope.get("compress") or {}
    scaling = {
        k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")
    }
    out.update(
        architectures=[V4_ENGINE],
        num_hidden_layers=int(data["num_target_layers"]),
        n_mtp_layers=int(data["num_hidden_layers"]),
        rope_theta=float((rope.get("main") or {}).get("rope_theta", data.get("rope_theta"))),
        compress_rope_theta=float(compress.get("rope_theta", data.get("compress_rope_theta"))),
        rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None,
        dspark_target_layer_ids=[int(i) for i in data["target_layer_ids"]],
        dspark_markov_rank=int(data.get("markov_rank") or 0),
        dspark_block_size=int(data["block_size"]),
        compress_ratios=[int(rates.get(t, 0)) if t in _V4_ATTENTION else 0 for t in target_types],
        num_hash_layers=list(data["target_mlp_layer_types"]).count("hash_moe"),
        qk_rope_head_dim=int(int(data["head_dim"]) * float(data["partial_rotary_factor"])),
        norm_topk_prob=True,  # the router renormalises its top-k weights
    )
    return out


def _v4_native_dict(data: dict) -> dict:
    """A V4 DSpark config.json (ours as written, vLLM's `DSparkDraftModel`, SGLang's name) -> ours
    (the fields DeepSeek's own directory names its way)."""
    if "dspark_target_layer_ids" not in data:  # a V4 model's own config.json, not a drafter's
        raise ConfigError(
            f"dspark_target_layer_ids: missing; a {data['architectures'][0]} config.json without "
            "it is a DeepSeek-V4 model, not a DSpark drafter"
        )
    out = {k: v for k, v in data.items() if k not in _V4_ENGINE_ONLY}
    if "n_mtp_layers" not in data:
        raise ConfigError("n_mtp_layers: missing from the DeepSeek-V4 DSpark config.json")
    out["architectures"] = [V4]
    out["num_hidden_layers"] = int(data["n_mtp_layers"])
    for ours, theirs in (
        ("target_layer_ids", "dspark_target_layer_ids"),
        ("markov_rank", "dspark_markov_rank"),
        ("block_size", "dspark_block_size"),
        ("mask_token_id", "dspark_noise_token_id"),
    ):
        if ours not in out and theirs in data:
            out[ours] = data[theirs]
    layers = int(out["num_hidden_layers"])
    out.setdefault("num_target_layers", int(data["num_hidden_layers"]))
    out.setdefault("target_layer_types", list(data.get("layer_types") or []))
    out.setdefault("target_mlp_layer_types", list(data.get("mlp_layer_types") or []))
    out["layer_types"] = ["sliding_attention"] * layers
    out["mlp_layer_types"] = ["moe"] * layers
    # transformers folds DeepSeek's RoPE fields (rope_theta, compress_rope_theta, rope_scaling)
    # into its nested rope_parameters
    out.setdefault("num_anchors", 512)  # training's own setting; the run's model section decides
    return out


def engine_dict(data: dict) -> dict:
    if data["architectures"][0] == V4:
        return _v4_engine_dict(data)
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
    if data["architectures"][0] in (V4, V4_ENGINE, "DeepseekV4ForCausalLMDSpark"):
        return _v4_native_dict(data)
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


# NOTE: vLLM resolves one mode for every draft layer from the config (a speculators
# config.json's sliding_window_non_causal becomes its dflash_config.causal)
VLLM_BLOCK_MASK = "vllm.model_executor.models.qwen3_dflash:dflash_has_any_non_causal"


def serving_format(data: dict) -> dict:
    gamma = int(data["block_size"])
    if _is_dflash(data):
        return dict(
            name="DFlash",
            architecture=DFLASH,
            vllm_method="dflash",
            num_speculative_tokens=gamma,
            sglang_algorithm="DFLASH",
            vllm_block_mask=VLLM_BLOCK_MASK,
        )
    why = _markov_unservable(data)
    if data["architectures"][0] != V4:
        return dict(
            name="DeepSpec DSpark",
            architecture=data["architectures"][0],
            vllm_method=None if why else "dspark",
            num_speculative_tokens=gamma,
            vllm_v2_runner=True,
            warnings=[why] if why else [],
        )
    sglang, notes = _v4_sglang(data) if why is None else (None, [])
    why = why or _v4_unservable(data)
    return dict(
        name="DeepSeek-V4 DSpark",
        architecture=V4_ENGINE,
        vllm_method=None if why else "dspark",
        num_speculative_tokens=gamma,
        vllm_v2_runner=True,
        sglang_algorithm=sglang,
        warnings=([why] if why else []) + notes,
    )


def _markov_unservable(data: dict) -> str | None:
    """Why the engines' DSpark (vLLM's; SGLang's V4 one too) cannot read these heads, or None."""
    rank = int(data.get("markov_rank") or 0)
    head = data.get("markov_head_type", "vanilla")
    if rank == 0:  # vLLM's loader then misses markov_head.markov_w1 / markov_w2
        return "markov_rank: 0; vLLM's dspark method needs a Markov head, and " + (
            "the engines' DFlash path the fill-in layout: train DFlash with sample_from_anchor "
            "false to serve it"
            if data.get("sample_from_anchor", True)
            else f"their DFlash path the Qwen3 backbone, not {data['architectures'][0]}"
        )
    if head != "vanilla":  # vLLM's loader has no place for the gate / GRU weights
        return f"markov_head_type: vLLM's DSpark has the vanilla Markov head, not {head!r}"
    if data.get("draft_vocab_size"):  # its head and Markov W2 are vocabulary-sized
        return (
            f"draft_vocab_size: {data['draft_vocab_size']}; vLLM's dspark method has no draft "
            "vocabulary map (d2t), its DFlash and Eagle3 methods do"
        )
    return None


def _v4_sglang(data: dict) -> tuple[str | None, list[str]]:
    """SGLang's `--speculative-algorithm` for a V4 drafter whose heads vLLM reads (None: SGLang
    cannot serve it), and what SGLang does differently, one line each (docs/serving.md)."""
    layers, taps = int(data["num_hidden_layers"]), len(data["target_layer_ids"])
    if layers != taps:  # SGLang sizes its stages (and main_proj) by the taps
        return None, [
            f"num_hidden_layers: {layers} draft layers for {taps} tapped layers; SGLang's V4 "
            "DSpark builds one draft layer per tapped layer (len(dspark_target_layer_ids)): "
            "train as many draft layers as taps to serve it there"
        ]
    if not data.get("sample_from_anchor", True):
        return None, ["sample_from_anchor: false; SGLang's V4 DSpark was not checked for it"]
    if not data.get("enable_confidence_head"):
        return "DSPARK", [
            "enable_confidence_head: false; SGLang's V4 DSpark builds its confidence head and "
            "refuses a checkpoint without one unless started with SGLANG_RAGGED_VERIFY_MODE=static"
        ]
    return "DSPARK", []


def _v4_unservable(data: dict) -> str | None:
    """Why vLLM's V4 DSpark cannot serve this V4 drafter as trained, or None."""
    if not data.get("sample_from_anchor", True):
        return "sample_from_anchor: false; vLLM's V4 DSpark drafts in the anchor layout"
    if data.get("enable_confidence_head") and not data.get("confidence_head_with_markov"):
        return (
            "confidence_head_with_markov: false; vLLM's V4 DSpark feeds its confidence head "
            "the Markov features"
        )
    return None


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
