"""SGLang's reading of DeepSeek-V4's own drafter (`model.backbone: target`): the export
(drafters/dspark/deepseek_v4.py) checked against SGLang's V4 DSpark loader as its source reads
it. SGLang is not installed here (it needs a GPU), so its name mapping, its loader's placement
and the parameter set its model builds are written out below from these files of
sgl-project/sglang (facts carried over, not code):

- python/sglang/srt/models/deepseek_v4_dspark.py at 00e5caa819f321e621ccec23e85146a3f41ae6b8
  (the `stages.*` layout; sglang PR 33276, 2026-08-02, logs the same names):
  `DeepseekV4ForCausalLMDSpark` builds one `DSparkV4Stage` per tapped layer
  (`len(dspark_target_layer_ids)`; `num_nextn_predict_layers` only without them), each a
  `DeepseekV4DecoderLayer` with `DSparkAttention` (compress ratio 0, `wq_a` and `wkv` unfused);
  stage 0 adds `main_proj` (taps x hidden -> hidden) and `main_norm`, the last stage `norm` and
  `hc_head_fn / base / scale`; `markov_head.markov_w1 / markov_w2` (the vanilla head, rank
  `dspark_markov_rank`), `confidence_head.proj` without a bias; the embedding and lm_head are
  the target's. `load_weights` maps each name with `_remap_dspark_weight_name` (anything not
  under `mtp.` skipped silently; `mtp.{s}.markov_head.*` / `confidence_head.*` to the model's
  heads; otherwise `stages.{s}.` with `attn.` -> `self_attn.`, `ffn.` -> `mlp.`, `attn_norm.` ->
  `input_layernorm.`, `ffn_norm.` -> `post_attention_layernorm.` (the first of each), `.w1.` /
  `.w2.` / `.w3.` -> `.gate_proj.` / `.down_proj.` / `.up_proj.`, `.gate.bias` ->
  `.gate.e_score_correction_bias`, `.scale` -> `.weight_scale_inv`), then places it through
  `DEEPSEEK_V4_STACKED_PARAMS_MAPPING` (`gate_proj` / `up_proj` -> `gate_up_proj`), FusedMoE's
  expert mapping (`experts.{e}.gate_proj.` / `up_proj.` -> `experts.w13_`, `down_proj.` ->
  `experts.w2_`) or as it is; a name that lands nowhere is logged as "unexpected weight" and
  dropped; a confidence head left without weights is an error.
- python/sglang/srt/models/deepseek_v4.py (the same tree): `MqaAttentionBase` (`attn_sink`,
  `wq_a`, `wkv`, `q_norm`, `wq_b`, `kv_norm`, `wo_a`, `wo_b`; asserts `num_key_value_heads ==
  1`), `make_hc_mixing_params` ((2 + hc) * hc mixing rows, 3 scales), `DeepseekV4DecoderLayer`
  (`input_layernorm`, `post_attention_layernorm`, `hc_attn_*`, `hc_ffn_*`, `mlp` a
  `DeepseekV2MoE`: `gate`, its `e_score_correction_bias`, `experts.w13_weight / w2_weight`,
  `shared_experts.gate_up_proj / down_proj`).
- python/sglang/srt/speculative/dspark_components/dspark_config.py at
  01f476234ab4ee99c7fb7cb31b68d31b6a7c54a8: `parse_dspark_draft_config` (`dspark_block_size`,
  `dspark_markov_rank`, `dspark_target_layer_ids`, the mask token from `dspark_noise_token_id`
  else `mask_token_id`); `draft_is_deepseek_v4` (the draft config.json's `architectures[0]` in
  `DeepseekV4ForCausalLM` / `...NextN`: the V4 attention backend and the MoE draft path), and
  `configs/model_config.py` maps a `DeepseekV4ForCausalLM` draft carrying `dspark_*` fields
  to `DeepseekV4ForCausalLMDSpark`. (`DSparkDraftModel` is SGLang's dense Qwen3-style DSpark,
  models/dspark.py.)

vLLM's reading of the same directory: tests/unit/test_deepseek_v4_drafter.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_ds.drafters.io import config_from_dict, load_draft_model, save_draft_model
from dspark_ds.drafters.serving import serving_format
from dspark_ds.errors import ConfigError

from helpers.evaluation import random_drafter
from helpers.moe_targets import tiny_moe_model

VOCAB = 16
LAYERS = 2  # draft layers, one per tapped layer as SGLang builds them
TAPS = (0, 2)

# config.json fields SGLang's V4 DSpark model reads (`config.<name>` in the files above)
SGLANG_V4_FIELDS = (
    "hidden_size",
    "vocab_size",
    "rms_norm_eps",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "sliding_window",
    "rope_theta",
    "compress_rope_theta",
    "max_position_embeddings",
    "hc_mult",
    "hc_eps",
    "hc_sinkhorn_iters",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "scoring_func",
    "norm_topk_prob",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "dspark_block_size",
    "dspark_markov_rank",
    "dspark_target_layer_ids",
)
_SKIPPED = ("embed.", "embed_tokens.", "head.", "lm_head.")
_FIRST_RENAMES = (
    ("attn.", "self_attn."),
    ("ffn.", "mlp."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
)
_EVERY_RENAMES = (
    (".w1.", ".gate_proj."),
    (".w2.", ".down_proj."),
    (".w3.", ".up_proj."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".scale", ".weight_scale_inv"),
)


def sglang_name(name: str) -> str | None:
    """A checkpoint name -> SGLang's `_remap_dspark_weight_name` of it (None: skipped)."""
    if name.startswith(_SKIPPED) or not name.startswith("mtp."):
        return None
    _, stage, rest = name.split(".", 2)
    if rest.startswith(("markov_head.", "confidence_head.")):
        return rest
    for old, new in _FIRST_RENAMES:
        rest = rest.replace(old, new, 1)
    for old, new in _EVERY_RENAMES:
        rest = rest.replace(old, new)
    return f"stages.{stage}.{rest}"


def sglang_place(mapped: str, params: dict, num_experts: int) -> tuple[str, str] | None:
    """Where SGLang's `load_weights` puts a mapped name: (parameter, shard), None: dropped."""
    for shard, part in enumerate(("gate_proj", "up_proj")):
        candidate = mapped.replace(part, "gate_up_proj")
        if part in mapped and candidate in params:
            return candidate, str(shard)
    for e in range(num_experts):
        for part, packed in (("gate_proj", "w13_"), ("up_proj", "w13_"), ("down_proj", "w2_")):
            key = f"experts.{e}.{part}."
            candidate = mapped.replace(key, f"experts.{packed}")
            if key in mapped and candidate in params:
                return candidate, f"{e}.{part}"
    return (mapped, "") if mapped in params else None


def sglang_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape) SGLang's `DeepseekV4ForCausalLMDSpark` builds for this
    config.json, shared experts unfused; per-expert shapes for the packed experts."""
    h, heads, dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    q, o, groups = config["q_lora_rank"], config["o_lora_rank"], config["o_groups"]
    hc, inter, experts = (
        config["hc_mult"],
        config["moe_intermediate_size"],
        config["n_routed_experts"],
    )
    mix = (2 + hc) * hc
    taps = config["dspark_target_layer_ids"]
    rank, vocab = config["dspark_markov_rank"], config["vocab_size"]
    stage = {
        "self_attn.attn_sink": (heads,),
        "self_attn.wq_a.weight": (q, h),
        "self_attn.wkv.weight": (dim, h),
        "self_attn.q_norm.weight": (q,),
        "self_attn.wq_b.weight": (heads * dim, q),
        "self_attn.kv_norm.weight": (dim,),
        "self_attn.wo_a.weight": (groups * o, heads * dim // groups),
        "self_attn.wo_b.weight": (h, groups * o),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        **{f"hc_{p}_fn": (mix, hc * h) for p in ("attn", "ffn")},
        **{f"hc_{p}_base": (mix,) for p in ("attn", "ffn")},
        **{f"hc_{p}_scale": (3,) for p in ("attn", "ffn")},
        "mlp.gate.weight": (experts, h),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.experts.w13_weight": (experts, 2 * inter, h),
        "mlp.experts.w2_weight": (experts, h, inter),
        "mlp.shared_experts.gate_up_proj.weight": (2 * inter * config["n_shared_experts"], h),
        "mlp.shared_experts.down_proj.weight": (h, inter * config["n_shared_experts"]),
    }
    last = len(taps) - 1
    params = {f"stages.{s}.{n}": shape for s in range(len(taps)) for n, shape in stage.items()}
    params |= {"stages.0.main_proj.weight": (h, len(taps) * h), "stages.0.main_norm.weight": (h,)}
    params |= {
        f"stages.{last}.norm.weight": (h,),
        f"stages.{last}.hc_head_fn": (hc, hc * h),
        f"stages.{last}.hc_head_base": (hc,),
        f"stages.{last}.hc_head_scale": (1,),
        "markov_head.markov_w1.weight": (vocab, rank),
        "markov_head.markov_w2.weight": (vocab, rank),
        "confidence_head.proj.weight": (1, h + rank),
    }
    return params


def _slice_shape(packed: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The part of a parameter one checkpoint tensor fills: all of it (""), a half of
    gate_up_proj ("0" / "1"), or one expert's gate / up half or down row ("{e}.{part}")."""
    if not where:
        return packed
    if "." not in where:
        return (packed[0] // 2, *packed[1:])
    return (packed[1] // (1 if where.endswith("down_proj") else 2), packed[2])


@pytest.fixture(scope="module")
def target():
    return tiny_moe_model("deepseek_v4", VOCAB)


@pytest.fixture(scope="module")
def export(target, tmp_path_factory):
    drafter = random_drafter(
        target, layer_ids=TAPS, markov_std=0.5, num_draft_layers=LAYERS, backbone="target"
    )
    out = tmp_path_factory.mktemp("v4_sglang")
    save_draft_model(drafter, out)
    return out


def _tensors(path: Path) -> dict[str, tuple[int, ...]]:
    raw = (path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def test_sglang_reads_the_config_as_its_v4_dspark_draft(export):
    """The raw `architectures[0]` is DeepSeek's (SGLang's V4 test), the fields its model reads
    are there, and its `parse_dspark_draft_config` gets our block, rank, taps and mask token;
    it builds one stage per tap, which is our draft layer count."""
    data = json.loads((export / "config.json").read_text())
    assert (
        data["architectures"] == ["DeepseekV4ForCausalLM"] and data["model_type"] == "deepseek_v4"
    )
    assert [f for f in SGLANG_V4_FIELDS if f not in data] == []
    assert data["num_key_value_heads"] == 1  # MqaAttentionBase asserts it
    assert "dspark_noise_token_id" not in data and data["mask_token_id"] == VOCAB - 1
    assert (data["dspark_block_size"], data["dspark_markov_rank"]) == (4, 8)
    assert data["dspark_target_layer_ids"] == list(TAPS)
    assert len(data["dspark_target_layer_ids"]) == data["n_mtp_layers"] == LAYERS
    assert data["enable_confidence_head"] and data["confidence_head_with_markov"]


def test_sglangs_loader_places_every_exported_weight_and_misses_none(export):
    """Every exported name goes through SGLang's mapping to a parameter its model has, with
    its shape (each expert into its row of the packed w13 / w2, the shared expert's w1 / w3
    into the halves of gate_up_proj), and every parameter gets its tensors: no "unexpected
    weight", nothing left at its initial value."""
    config = json.loads((export / "config.json").read_text())
    params = sglang_parameters(config)
    filled: dict[str, set[str]] = {}
    for name, shape in _tensors(export).items():
        mapped = sglang_name(name)
        assert mapped is not None, f"{name}: skipped by SGLang's mapping"
        placed = sglang_place(mapped, params, config["n_routed_experts"])
        assert placed is not None, f"{name} -> {mapped}: unexpected weight in SGLang"
        param, where = placed
        assert shape == _slice_shape(params[param], where), name
        filled.setdefault(param, set()).add(where)
    assert sorted(set(params) - set(filled)) == []
    experts = {
        f"{e}.{p}" for e in range(config["n_routed_experts"]) for p in ("gate_proj", "up_proj")
    }
    for s in range(LAYERS):
        assert filled[f"stages.{s}.mlp.experts.w13_weight"] == experts
        assert filled[f"stages.{s}.mlp.shared_experts.gate_up_proj.weight"] == {"0", "1"}


def test_the_v4_confidence_head_has_no_bias_as_the_engines_build_it(target):
    """SGLang's and vLLM's V4 DSpark build `confidence_head.proj` without a bias (a `proj.bias`
    is dropped by SGLang, a KeyError in vLLM's loader); the Qwen3-style drafter keeps its bias
    (vLLM's Qwen3 DSpark builds one)."""
    v4 = random_drafter(target, layer_ids=TAPS, num_draft_layers=LAYERS, backbone="target")
    qwen3 = random_drafter(target, layer_ids=TAPS, num_draft_layers=LAYERS)
    assert v4.confidence_head.proj.bias is None
    assert qwen3.confidence_head.proj.bias is not None


def test_serve_check_prints_sglangs_dspark_command(export, target):
    drafter = load_draft_model(export, shared_weights=(
        target.model.embed_tokens.weight, target.lm_head.weight,
    ))  # fmt: skip
    fmt = serving_format({**drafter.config.to_dict(), "architectures": ["DSparkDraftModel"]})
    assert (fmt.vllm_method, fmt.sglang_algorithm, fmt.warnings) == ("dspark", "DSPARK", ())
    assert fmt.architecture == "DeepseekV4ForCausalLM"
    assert fmt.sglang_command("T", "D") == (
        "python -m sglang.launch_server --model-path T --speculative-algorithm DSPARK "
        "--speculative-draft-model-path D --speculative-num-draft-tokens 5"
    )


@pytest.mark.parametrize(
    "change, vllm, sglang, note",
    [
        ({"num_hidden_layers": 3}, "dspark", None, "one draft layer per tapped layer"),
        ({"enable_confidence_head": False}, "dspark", "DSPARK", "SGLANG_RAGGED_VERIFY_MODE"),
        ({"sample_from_anchor": False}, None, None, "SGLang's V4 DSpark was not checked"),
        ({"markov_head_type": "gated"}, None, None, "vanilla Markov head"),
    ],
    ids=["layers-not-taps", "no-confidence", "fill-in", "gated"],
)
def test_what_sglang_cannot_serve_or_serves_differently_is_named(
    target, change, vllm, sglang, note
):
    drafter = random_drafter(target, layer_ids=TAPS, num_draft_layers=LAYERS, backbone="target")
    data = {**drafter.config.to_dict(), "architectures": ["DSparkDraftModel"], **change}
    fmt = serving_format(data)
    assert (fmt.vllm_method, fmt.sglang_algorithm) == (vllm, sglang)
    assert any(note in w for w in fmt.warnings), fmt.warnings


def test_a_v4_model_config_is_not_read_as_a_drafter_and_older_exports_still_are(export):
    data = json.loads((export / "config.json").read_text())
    model = {k: v for k, v in data.items() if not k.startswith("dspark_")}
    with pytest.raises(ConfigError, match="^dspark_target_layer_ids: missing; a Deepseek"):
        config_from_dict(model)
    for name in ("DSparkDraftModel", "DeepseekV4ForCausalLMDSpark"):
        config = config_from_dict({**data, "architectures": [name]})
        assert config.architectures == ["DSparkDraftModel"] and config.num_hidden_layers == LAYERS
