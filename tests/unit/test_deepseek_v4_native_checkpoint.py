"""The tiny DeepSeek-V4 target written as DeepSeek's own checkpoint (the layout vLLM's V4 model
loads): transformers' V4 reader, which renames DeepSeek's names to its own, reads it back to the
same model."""

import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers.moe_targets import (
    VLLM_V4_GEOMETRY,
    build_tiny_moe_target,
    deepseek_v4_native_checkpoint,
)


def test_native_checkpoint_reads_back_to_the_same_model(tmp_path):
    target = build_tiny_moe_target(tmp_path / "hf", "deepseek_v4", **VLLM_V4_GEOMETRY)
    native = deepseek_v4_native_checkpoint(target, tmp_path / "native")

    with safe_open(f"{native}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("model.") for n in names)
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn"):
        assert name in names
    assert "layers.1.attn.kv_norm.weight" in names and "layers.1.attn.norm.weight" not in names
    assert "layers.1.attn.indexer.compressor.wkv.weight" in names
    assert "layers.0.ffn.gate.tid2eid" in names and "layers.1.ffn.gate.bias" in names
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["compress_ratios"] == [0, 4, 128, 0] and config["num_hash_layers"] == 1

    original = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    read, info = AutoModelForCausalLM.from_pretrained(
        native, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    ids = torch.randint(3, original.config.vocab_size, (1, 40), generator=torch.manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(read.eval()(ids).logits, original(ids).logits, rtol=0, atol=0)
