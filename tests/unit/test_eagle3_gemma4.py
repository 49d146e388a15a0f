"""Eagle3 on the Gemma4 backend: config, reference parameter names, the Gemma4 layer against a
naive formula, train/serve parity, the chunked loss, and lossless greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

from dspark_ds.drafters import load_draft_model, save_draft_model
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.eagle3.gemma4 import Gemma4Eagle3Model
from dspark_ds.drafters.eagle3.loss import eagle3_forward_and_loss
from dspark_ds.drafters.io import build_draft_model

from helpers.drafters import spread_weights
from helpers.gemma4 import VOCAB, tiny_gemma4_target_config, tiny_gemma4_text

LAYER_IDS = [0, 1, 2]


def gemma4_eagle3(seed: int = 0, num_draft_layers: int = 1, target_config=None, **text_kw):
    target_config = target_config or tiny_gemma4_target_config(**text_kw)
    cfg = build_eagle3_config(
        target_config, target_layer_ids=LAYER_IDS, ttt_length=3, num_draft_layers=num_draft_layers
    )
    torch.manual_seed(seed)
    model = build_draft_model(cfg)
    spread_weights(model)
    with torch.no_grad():
        for layer in model.layers:
            layer.layer_scalar.fill_(0.7)
    model.freeze_shared()
    return model.eval()


def batch(bsz: int = 2, seq: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(bsz, seq)
    mask[:, :2] = 0
    return {
        "input_ids": torch.randint(0, VOCAB, (bsz, seq), generator=g),
        "loss_mask": mask,
        "target_hidden_states": torch.randn(bsz, seq, 3 * 32, generator=g),
        "target_last_hidden_states": torch.randn(bsz, seq, 32, generator=g),
    }


@pytest.mark.parametrize("wrapped", [True, False], ids=["multimodal-wrapper", "text-only"])
def test_config_names_and_round_trip(tmp_path, wrapped):
    target = tiny_gemma4_target_config() if wrapped else Gemma4TextConfig(**tiny_gemma4_text())
    cfg = build_eagle3_config(target, target_layer_ids=LAYER_IDS)
    assert cfg.architectures == ["Gemma4Eagle3Model"] and cfg.num_hidden_layers == 1
    assert cfg.target_text_model_type == "gemma4_text"
    assert cfg.target_model_type == ("gemma4" if wrapped else "gemma4_text")
    model = gemma4_eagle3(target_config=target)
    names = set(model.state_dict())
    layer = {
        f"layers.0.{n}"
        for n in (
            "hidden_norm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "layer_scalar",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    }
    assert names == layer | {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"}
    # k_eq_v: no v_proj; the full-attention head shape (global_head_dim 16, 1 K/V head).
    assert model.state_dict()["layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    out = save_draft_model(model, tmp_path / "d")
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["Gemma4Eagle3Model"] and "block_size" not in data
    assert data["global_head_dim"] == 16 and data["num_global_key_value_heads"] == 1
    assert data["ttt_length"] == 3 and data["target_layer_ids"] == LAYER_IDS
    loaded = load_draft_model(out)
    assert isinstance(loaded, Gemma4Eagle3Model)
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**b).draft_logits, model(**b).draft_logits)


def _rms(x, weight=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def test_step0_equals_a_naive_gemma4_layer():
    """Step 0 at the first position attends to itself only: the whole Gemma4 layer, by hand."""
    model = gemma4_eagle3(seed=1)
    b = batch(bsz=1)
    with torch.no_grad():
        got = model(**b).draft_logits[0, 0, 0]
        sd = model.state_dict()
        w = lambda n: sd[f"layers.0.{n}"]  # noqa: E731
        tok = int(b["input_ids"][0, 1])
        emb = sd["embed_tokens.weight"][tok] * 32**0.5
        h = sd["fc.weight"] @ b["target_hidden_states"][0, 0]
        x = torch.cat([_rms(emb, w("input_layernorm.weight")), _rms(h, w("hidden_norm.weight"))])
        k_raw = w("self_attn.k_proj.weight") @ x
        v = _rms(k_raw)  # one key: softmax weight 1, so RoPE and q do not matter
        attn = w("self_attn.o_proj.weight") @ v.repeat(4)  # 4 query heads share the K/V head
        h = h + _rms(attn, w("post_attention_layernorm.weight"))
        y = _rms(h, w("pre_feedforward_layernorm.weight"))
        gate = torch.nn.functional.gelu(w("mlp.gate_proj.weight") @ y, approximate="tanh")
        mlp = w("mlp.down_proj.weight") @ (gate * (w("mlp.up_proj.weight") @ y))
        h = (h + _rms(mlp, w("post_feedforward_layernorm.weight"))) * 0.7
        logits = sd["lm_head.weight"] @ _rms(h, sd["norm.weight"])
        want = torch.tanh(logits / 5.0) * 5.0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_gemma4_train_serve_parity(num_layers):
    model = gemma4_eagle3(seed=2, num_draft_layers=num_layers)
    b = batch(bsz=1)
    ids, feats = b["input_ids"], b["target_hidden_states"]
    with torch.no_grad():
        train = model(**b).draft_logits[0]
        for t in (0, 4):
            cache = model.new_cache()
            last = model.extend(model.project_context(feats[:, : t + 1]), ids[:, 1 : t + 2], cache)
            last = last[:, -1:]
            for k in range(3):
                torch.testing.assert_close(
                    model.compute_logits(last)[0, 0], train[t, k], rtol=1e-4, atol=1e-5
                )
                last = model.extend(last, ids[:, t + k + 2 : t + k + 3], cache)


def test_gemma4_chunked_loss_matches_reference():
    model = gemma4_eagle3(seed=3).train()
    b = batch()
    results = {}
    for impl in ("reference", "chunked"):
        model.zero_grad()
        loss, metrics = eagle3_forward_and_loss(model, b, impl=impl, chunk_rows=7)
        loss.backward()
        results[impl] = (loss.item(), metrics["tau_probabilistic"], model.fc.weight.grad.clone())
    ref, ch = results["reference"], results["chunked"]
    assert ch[0] == pytest.approx(ref[0], rel=1e-5) and ch[1] == pytest.approx(ref[1], rel=1e-5)
    torch.testing.assert_close(ch[2], ref[2], rtol=1e-4, atol=1e-6)


def test_gemma4_eagle3_greedy_decoding_is_lossless():
    from transformers import Gemma4ForConditionalGeneration

    from dspark_ds.eval.decoding import speculative_generate, target_generate

    torch.manual_seed(0)
    target_cfg = tiny_gemma4_target_config(final_logit_softcapping=30.0, sliding_window=6)
    target = Gemma4ForConditionalGeneration(target_cfg).eval()
    drafter = gemma4_eagle3(seed=4, target_config=target_cfg)
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    for seed in range(2):
        ids = torch.randint(0, VOCAB - 1, (1, 10), generator=torch.Generator().manual_seed(seed))
        want = target_generate(target, ids, max_new_tokens=16)
        got, stats = speculative_generate(target, drafter, ids, max_new_tokens=16)
        assert got.tolist() == want.tolist()
        assert stats.new_tokens == 16
