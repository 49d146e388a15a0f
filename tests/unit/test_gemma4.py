"""Gemma4 backend (docs/algorithm.md#gemma4): golden reproduction, config layouts, refusals, naive reference."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import Gemma4Config
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

from dspark_ds.drafters import build_draft_config, build_draft_model, load_draft_model
from dspark_ds.drafters.common.gemma4 import full_attention_dims
from dspark_ds.drafters.dspark.gemma4 import Gemma4DSparkModel
from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.io import save_draft_model
from dspark_ds.drafters.perf import ATTN_IMPLEMENTATIONS

from helpers.drafters import (
    DFLASH,
    MASK_ID,
    VOCAB,
    checked_blocks,
    parity_rounds,
    random_batch,
    tiny_drafter,
)
from helpers.gemma4 import (
    CAP,
    greedy_without_cache,
    repeating_gemma4_pair,
    tiny_gemma4_target_config,
    tiny_gemma4_text,
)
from helpers.golden import check_golden, run_golden


def gemma4_drafter(seed: int = 0, **draft_kw):
    text_kw = draft_kw.pop("text", {})
    return tiny_drafter(seed, target_config=tiny_gemma4_target_config(**text_kw), **draft_kw)


# ---- golden --------------------------------------------------------------------------------
def test_gemma4_golden_reproduces(golden_dir):
    check_golden(golden_dir / "gemma4_vanilla")


def test_gemma4_golden_backward_is_finite(golden_dir):
    folder = golden_dir / "gemma4_vanilla"
    model, _ = run_golden(folder)
    assert isinstance(model, Gemma4DSparkModel)
    from safetensors.torch import load_file

    inputs = load_file(str(folder / "inputs.safetensors"))
    model.train()
    loss, _ = compute_dspark_loss(model(**inputs))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in grads and "lm_head.weight" not in grads
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.0.self_attn.k_proj.weight"].abs().sum() > 0


def test_gemma4_golden_through_the_training_loss_path(golden_dir):
    """The trainer's chunked loss (softcap inside `compute_logits`, under autograd) reproduces
    the golden loss and metrics, and its gradients equal the reference path's."""
    from safetensors.torch import load_file

    from dspark_ds.drafters.dspark.step import forward_and_loss

    folder = golden_dir / "gemma4_vanilla"
    expected = json.loads((folder / "expected.json").read_text())
    model = load_draft_model(folder / "draft").train()
    inputs = load_file(str(folder / "inputs.safetensors"))
    grads = {}
    for impl in ("reference", "chunked"):
        model.zero_grad(set_to_none=True)
        loss, metrics = forward_and_loss(
            model, inputs, expected["loss_args"], impl=impl, chunk_anchors=2
        )
        loss.backward()
        assert loss.item() == pytest.approx(expected["loss"], rel=1e-5), impl
        for name, value in expected["metrics"].items():
            assert metrics[name] == pytest.approx(value, rel=1e-5), (impl, name)
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads["chunked"]) == set(grads["reference"])
    for name, g in grads["reference"].items():
        torch.testing.assert_close(grads["chunked"][name], g, rtol=1e-5, atol=1e-6, msg=name)


# ---- config layouts ----------------------------------------------------------------------
def _outputs(model, folder):
    from safetensors.torch import load_file

    inputs = load_file(str(folder / "inputs.safetensors"))
    with torch.no_grad():
        return model(**inputs)


def test_golden_config_loads_and_resaves_in_the_reference_layout(tmp_path, golden_dir):
    """The golden config.json (transformers 5.10: `global_head_dim`, ...) round-trips."""
    folder = golden_dir / "gemma4_vanilla"
    model = load_draft_model(folder / "draft")
    assert full_attention_dims(model.config) == (32, 1)
    attn = model.layers[0].self_attn
    assert attn.v_proj is None and attn.scaling == 1.0 and attn.k_proj.out_features == 32
    assert model.rotary_emb.full_attention_inv_freq.shape == (16,)
    # proportional RoPE with partial_rotary_factor 0.25: only 4 of the 16 frequencies rotate
    assert int((model.rotary_emb.full_attention_inv_freq != 0).sum()) == 4

    save_draft_model(model, tmp_path / "resaved")
    written = json.loads((tmp_path / "resaved" / "config.json").read_text())
    golden = json.loads((folder / "draft" / "config.json").read_text())
    assert written["architectures"] == ["Gemma4DSparkModel"]
    assert "per_layer_config" not in written
    for key in (
        "global_head_dim",
        "num_global_key_value_heads",
        "head_dim",
        "num_key_value_heads",
        "attention_k_eq_v",
        "final_logit_softcapping",
        "target_model_type",
        "target_text_model_type",
        "layer_types",
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "markov_rank",
    ):
        assert written[key] == golden[key], key
    assert (
        written["rope_parameters"]["full_attention"] == golden["rope_parameters"]["full_attention"]
    )
    reloaded = load_draft_model(tmp_path / "resaved")
    a, b = _outputs(model, folder), _outputs(reloaded, folder)
    assert torch.equal(a.draft_logits, b.draft_logits)


def test_newer_transformers_layout_loads(tmp_path, golden_dir):
    """Newer releases write `per_layer_config` instead of `global_head_dim`; same drafter."""
    folder = golden_dir / "gemma4_vanilla"
    data = json.loads((folder / "draft" / "config.json").read_text())
    newer = Gemma4TextConfig.from_dict(data).to_dict()
    assert "global_head_dim" not in newer and newer["per_layer_config"]
    newer["architectures"] = data["architectures"]
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "config.json").write_text(json.dumps(newer))
    shutil.copy(folder / "draft" / "model.safetensors", tmp_path / "newer")
    model = load_draft_model(tmp_path / "newer")
    assert full_attention_dims(model.config) == (32, 1)
    a = _outputs(model, folder)
    b = _outputs(load_draft_model(folder / "draft"), folder)
    assert torch.equal(a.draft_logits, b.draft_logits)


@pytest.mark.parametrize("wrapped", [True, False], ids=["multimodal-wrapper", "text-only"])
def test_draft_config_from_a_gemma4_target(tmp_path, wrapped):
    target = tiny_gemma4_target_config() if wrapped else Gemma4TextConfig(**tiny_gemma4_text())
    cfg = build_draft_config(
        target, target_layer_ids=[0, 1, 2], mask_token_id=MASK_ID, num_draft_layers=3
    )
    assert cfg.architectures == ["Gemma4DSparkModel"]
    assert cfg.target_model_type == ("gemma4" if wrapped else "gemma4_text")
    assert cfg.target_text_model_type == "gemma4_text"
    assert cfg.num_target_layers == 4 and cfg.num_hidden_layers == 3
    assert cfg.layer_types == ["full_attention"] * 3 and cfg.tie_word_embeddings is False
    # Per-layer attributes follow the drafter's 3 layers, not the target's 4.
    assert full_attention_dims(cfg) == (16, 1)
    model = build_draft_model(cfg)
    assert isinstance(model, Gemma4DSparkModel) and len(model.layers) == 3
    for layer in model.layers:
        assert layer.self_attn.q_proj.out_features == 4 * 16
        assert layer.self_attn.v_proj is None
        assert layer.layer_scalar.tolist() == [1.0]
    assert "layers.0.layer_scalar" in model.state_dict()
    out = save_draft_model(model, tmp_path / "d")
    written = json.loads((out / "config.json").read_text())
    assert written["global_head_dim"] == 16 and written["num_global_key_value_heads"] == 1
    assert written["target_model_type"] == cfg.target_model_type
    reloaded = load_draft_model(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


# ---- refusals ------------------------------------------------------------------------------
REFUSED = [
    (
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
        "enable_moe_block",
    ),
    (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input"),
    (dict(num_kv_shared_layers=2, use_double_wide_mlp=True), "use_double_wide_mlp"),
]
IDS = ["moe", "per-layer-input", "double-wide-mlp"]


@pytest.mark.parametrize("overrides,field", REFUSED, ids=IDS)
def test_unsupported_targets_are_refused(overrides, field):
    target = tiny_gemma4_target_config(**overrides)
    with pytest.raises(ValueError, match=field):
        build_draft_config(target, target_layer_ids=[0, 1], mask_token_id=MASK_ID)


@pytest.mark.parametrize("overrides,field", REFUSED, ids=IDS)
def test_unsupported_drafter_directories_are_refused(tmp_path, golden_dir, overrides, field):
    src = golden_dir / "gemma4_vanilla" / "draft"
    data = json.loads((src / "config.json").read_text())
    data.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(data))
    shutil.copy(src / "model.safetensors", tmp_path)
    with pytest.raises(ValueError, match=field):
        load_draft_model(tmp_path)


def test_target_kv_sharing_does_not_reach_the_drafter(tmp_path, golden_dir):
    """K/V-sharing targets (without double-wide MLPs) are fine: draft layers never share."""
    target = tiny_gemma4_target_config(num_kv_shared_layers=2)
    cfg = build_draft_config(target, target_layer_ids=[0, 1], mask_token_id=MASK_ID)
    assert cfg.num_kv_shared_layers == 0
    # a directory whose config still carries the target's value loads with plain MLPs
    src = golden_dir / "gemma4_vanilla" / "draft"
    data = json.loads((src / "config.json").read_text())
    data["num_kv_shared_layers"] = 8
    (tmp_path / "config.json").write_text(json.dumps(data))
    shutil.copy(src / "model.safetensors", tmp_path)
    model = load_draft_model(tmp_path)
    assert model.layers[1].mlp.up_proj.out_features == data["intermediate_size"]


# ---- the math, against a naive one-block reference ------------------------------------------
def _rms(x, weight=None, eps=1e-6):
    x = x * (x.pow(2).mean(-1, keepdim=True) + eps).pow(-0.5)
    return x if weight is None else x * weight


def _rope(x, pos, inv_freq):
    angles = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def naive_gemma4_block(model, input_ids, feats, anchor: int, labels: torch.Tensor):
    """One block written out from docs/algorithm.md#gemma4 with explicit loops; returns (logits, base logits)."""
    G, H = model.block_size, model.config.hidden_size
    ctx = _rms(model.fc(feats[:anchor]), model.hidden_norm.weight)
    ids = torch.full((G,), model.mask_token_id)
    ids[0] = input_ids[anchor]
    h = model.embed_tokens.weight[ids] * math.sqrt(H)
    pos_ctx, pos_draft = torch.arange(anchor), torch.arange(anchor, anchor + G)
    pos_k = torch.cat([pos_ctx, pos_draft])
    inv_freq = model.rotary_emb.full_attention_inv_freq
    for layer in model.layers:
        attn = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight)
        hd, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        q = _rms(attn.q_proj(x).view(G, nh, hd), attn.q_norm.weight)
        src = torch.cat([ctx, x])
        k_raw = attn.k_proj(src).view(-1, nkv, hd)
        k = _rms(k_raw, attn.k_norm.weight)
        v = _rms(k_raw if attn.v_proj is None else attn.v_proj(src).view(-1, nkv, hd))
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = _rope(q[:, head], pos_draft, inv_freq) @ _rope(k[:, kv], pos_k, inv_freq).T
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv])  # scaling 1.0
        h = h + _rms(attn.o_proj(torch.cat(heads, -1)), layer.post_attention_layernorm.weight)
        mlp = layer.mlp(_rms(h, layer.pre_feedforward_layernorm.weight))
        h = (h + _rms(mlp, layer.post_feedforward_layernorm.weight)) * layer.layer_scalar
    h = _rms(h, model.norm.weight)
    cap = model.config.final_logit_softcapping
    base = torch.tanh(model.lm_head(h) / cap) * cap
    logits = base
    if model.markov_head is not None:
        prev = torch.cat([input_ids[anchor : anchor + 1], labels[:-1]])
        w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
        logits = base + (w1[prev] @ w2.T)
    return logits, base


@pytest.mark.parametrize(
    "heads,text",
    [
        (dict(), dict()),
        (dict(), dict(attention_k_eq_v=False)),
        (DFLASH, dict(attention_k_eq_v=False, num_global_key_value_heads=None)),
    ],
    ids=["k_eq_v", "separate-v", "dflash-separate-v"],
)
def test_batched_forward_equals_naive_gemma4_blocks(heads, text):
    model = gemma4_drafter(text=text, **heads)
    with torch.no_grad():
        model.layers[0].layer_scalar.fill_(0.7)  # a non-trivial buffer value must be applied
    attn = model.layers[0].self_attn
    assert (attn.v_proj is None) == text.get("attention_k_eq_v", True)
    batch = random_batch(model)
    with torch.no_grad():
        out = model(**batch, generator=torch.Generator().manual_seed(3))
        bases = [base for _, _, base in checked_blocks(naive_gemma4_block, model, batch, out)]
        assert bases
        assert all(base.abs().max() <= CAP for base in bases)  # the cap, then the Markov bias
    assert torch.isfinite(out.draft_logits).all()


def test_gemma4_train_serve_parity():
    """An inference round at start=p (KV cache) == the training block at anchor p."""
    model = gemma4_drafter(markov_head_type="rnn")
    with torch.no_grad():
        for out, batch, ids, a, p, cache in parity_rounds(model):
            # two context chunks: the cache appends across rounds
            half = p // 2
            block = torch.full((1, model.block_size), model.mask_token_id)
            block[0, 0] = ids[half]
            model.forward_draft_block(
                context_features=batch["target_hidden_states"][:, :half],
                block_input_ids=block,
                start=half,
                cache=cache,
            )
            block[0, 0] = ids[p]
            hidden = model.forward_draft_block(
                context_features=batch["target_hidden_states"][:, half:p],
                block_input_ids=block,
                start=p,
                cache=cache,
            )
            _, logits = model.sample_draft_tokens(
                model.compute_logits(hidden),
                first_prev_token_ids=ids[p : p + 1],
                hidden_states=hidden,
                forced_tokens=out.target_ids[0, a].unsqueeze(0),
            )
            torch.testing.assert_close(logits[0], out.draft_logits[0, a], atol=1e-4, rtol=1e-4)
            assert cache.seq_length == p


@pytest.mark.parametrize("impl", [i for i in ATTN_IMPLEMENTATIONS if i != "dense"])
def test_gemma4_attention_implementations_agree(impl):
    model = gemma4_drafter()
    batch = random_batch(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.attn_implementation = "dense"
        dense = model(**batch, generator=g)
        model.attn_implementation = impl
        other = model(
            **batch, anchor_positions=dense.anchor_positions, block_keep_mask=dense.block_keep_mask
        )
    keep = dense.block_keep_mask
    torch.testing.assert_close(
        dense.draft_logits[keep], other.draft_logits[keep], atol=1e-4, rtol=1e-4
    )


# ---- decoding against a real Gemma4 target ------------------------------------------------
@torch.no_grad()
def test_lossless_greedy_decoding_on_a_sliding_window_gemma4_target():
    """Speculative greedy == plain greedy on a Gemma4 target whose sliding-window layers are
    shorter than the text, with drafts fully accepted, partly accepted and rejected."""
    from dspark_ds.eval.decoding import speculative_generate

    target, drafter = repeating_gemma4_pair()
    accepted: list[int] = []
    for seed in range(3):
        ids = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(seed))
        want = greedy_without_cache(target, ids, 30, set())
        got, stats = speculative_generate(target, drafter, ids, max_new_tokens=30)
        assert got.tolist() == want.tolist(), f"seed {seed}: speculative != greedy"
        accepted += stats.accepted_per_round
    assert max(accepted) == 4 and min(accepted) == 0 and any(0 < a < 4 for a in accepted)


def test_training_taps_equal_decoding_taps_on_a_gemma4_wrapper():
    """Cache / online features (FrozenTarget hooks on the text model inside the multimodal
    wrapper) == the features decoding taps from HF hidden_states (train/serve parity)."""
    from transformers import Gemma4ForConditionalGeneration

    from dspark_ds.eval.target_step import tap_layers
    from dspark_ds.target import FrozenTarget

    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(tiny_gemma4_target_config(sliding_window=6)).eval()
    layer_ids = [-1, 0, 2]
    target = FrozenTarget(model, layer_ids)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    feats, last = target(ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(feats, tap_layers(out.hidden_states, layer_ids))
    assert torch.equal(last, out.hidden_states[-1])
    # -1 is Gemma4's *scaled* embedding output, as HF's hidden_states[0]
    scale = math.sqrt(model.config.text_config.hidden_size)
    torch.testing.assert_close(feats[..., :32], model.get_input_embeddings().weight[ids] * scale)
    # the drafter's aligned target logits (softcapped lm_head) == the target's own logits
    cfg = build_draft_config(model.config, target_layer_ids=[0, 2], mask_token_id=MASK_ID)
    drafter = build_draft_model(cfg)
    drafter.initialize_embeddings_and_head(
        model.get_input_embeddings().weight, model.get_output_embeddings().weight
    )
    with torch.no_grad():
        torch.testing.assert_close(drafter.compute_logits(last), out.logits, atol=1e-5, rtol=0)


# ---- recipes -------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["dspark", "dflash"])
def test_gemma4_12b_recipes_build_a_drafter_config(algo):
    """The recipes parse, carry the paper's Gemma4 defaults, and fit a 48-layer Gemma4 target."""
    from pathlib import Path

    from dspark_ds.cli import parse_config

    recipe = Path(__file__).resolve().parents[2] / "dspark_ds" / "recipes"
    cfg = parse_config("train", ["--config", str(recipe / f"{algo}_gemma4_12b.yaml")])
    assert cfg.target.layer_ids == [5, 17, 29, 41, 46] and cfg.model.mask_token_id == 4
    assert "gemma-4" in cfg.target.path
    # A config-only stand-in with the 12B's depth and Gemma4's real vocabulary (no weights).
    target = Gemma4Config(
        text_config=dict(num_hidden_layers=48, hidden_size_per_layer_input=0, vocab_size=262_144)
    )
    m = cfg.model
    draft = build_draft_config(
        target,
        target_layer_ids=cfg.target.layer_ids,
        mask_token_id=m.mask_token_id,
        num_draft_layers=m.num_draft_layers,
        block_size=m.block_size,
        num_anchors=m.num_anchors,
        markov_rank=m.markov_rank,
        markov_head_type=m.markov_head_type,
        confidence_head_alpha=m.confidence_head_alpha,
        confidence_head_with_markov=m.confidence_head_with_markov,
    )
    assert draft.architectures == ["Gemma4DSparkModel"] and draft.num_target_layers == 48
    assert draft.num_hidden_layers == 5 and draft.block_size == 7
    assert draft.markov_rank == (256 if algo == "dspark" else 0)
    assert draft.enable_confidence_head == (algo == "dspark")
