"""Every shipped recipe parses against `dspark-ds train`, carries the paper's defaults and agrees
with the drafter preset it names (dspark_ds/drafters/presets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_ds.cli import parse_config
from dspark_ds.drafters.presets import PRESET_NAMES, preset, preset_fields

RECIPES = sorted((Path(__file__).resolve().parents[2] / "dspark_ds" / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    for algo in ("dspark", "dflash"):
        for size in ("4b", "8b", "14b"):
            assert f"{algo}_qwen3_{size}" in names
        assert f"{algo}_qwen3_5_9b" in names
    assert "tiny_cpu" in names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses(path):
    cfg = parse_config("train", ["--config", str(path)])
    if "tiny" in path.stem:
        assert cfg.train.synthetic_samples > 0 and cfg.train.precision == "fp32"
        # the quick-start recipes keep the safe default: a rerun never continues silently
        assert cfg.checkpoint.resume is None
        return
    if not path.stem.startswith(("dspark", "dflash")):
        return  # other drafter families (eagle3) own their recipe checks
    # the paper's shared recipe (docs/algorithm.md#configurations)
    assert cfg.train.lr == 6e-4 and cfg.train.warmup_ratio == 0.04
    assert cfg.train.weight_decay == 0.0 and cfg.train.precision == "bf16"
    assert cfg.train.global_batch_size == 512 and cfg.train.num_epochs == 10
    assert cfg.train.max_grad_norm == 1.0 and cfg.data.max_length == 4096
    shape = (cfg.model.block_size, cfg.model.num_draft_layers, cfg.model.num_anchors)
    if path.stem in PUBLISHED_SHAPES:  # the published drafter's shape, not the paper's
        assert shape == PUBLISHED_SHAPES[path.stem][:3]
        assert cfg.model.backbone == PUBLISHED_SHAPES[path.stem][3]
    else:
        assert shape == (7, 5, 512) and cfg.model.backbone == "auto"
    assert cfg.model.loss_decay_gamma == 4.0
    if path.stem.startswith("dspark"):
        assert cfg.model.markov_rank == 256 and cfg.model.markov_head_type == "vanilla"
        assert cfg.model.confidence_head_alpha == 1.0 and cfg.model.confidence_head_with_markov
        assert (cfg.model.ce_loss_alpha, cfg.model.l1_loss_alpha) == (0.1, 0.9)
    else:
        assert cfg.model.markov_rank == 0 and cfg.model.confidence_head_alpha == 0.0
        assert (cfg.model.ce_loss_alpha, cfg.model.l1_loss_alpha) == (1.0, 0.0)
    ids = [1, 10, 19, 28, 37] if "14b" in path.stem else [1, 9, 17, 25, 33]
    if "32b" in path.stem:  # Qwen3-32B, 64 layers: default_layer_ids(64)
        ids = [1, 16, 31, 46, 61]
    if "gemma4" in path.stem:  # Gemma4-12B, 48 layers; see tests/unit/test_gemma4.py
        ids = [5, 17, 29, 41, 46]
    if "qwen3_5_9b" in path.stem:  # Qwen3.5-9B, 32 layers (a hybrid): the same rule
        ids = [1, 8, 15, 22, 29]
    if "deepseek_v4_flash" in path.stem:  # DeepSeek-V4-Flash, 43 layers: default_layer_ids(43)
        ids = [1, 11, 20, 30, 40]
    if "glm5" in path.stem:  # GLM-5, 78 layers: default_layer_ids(78)
        ids = [1, 20, 38, 56, 75]
    if "deepseek_v32" in path.stem or "kimi_k25" in path.stem:  # 61 layers each
        ids = [1, 15, 30, 44, 58]  # default_layer_ids(61)
    if "minimax_m2" in path.stem:  # MiniMax-M2, 62 layers: default_layer_ids(62)
        ids = [1, 16, 30, 44, 59]
    assert cfg.target.layer_ids == ids


@pytest.mark.parametrize("algo", ["dspark", "dflash"])
def test_the_qwen3_5_recipe_builds_its_drafter_from_a_qwen3_5_9b_config(algo):
    """transformers' Qwen3.5 defaults are the 9B's text config (32 layers, 24 Gated DeltaNet + 8
    full attention, hidden 4096, head_dim 256, partial RoPE, vocabulary 248320): the recipe's
    tapped ids follow default_layer_ids, its mask id lies in the vocabulary, and the drafter is
    sized from that config (a Qwen3-style drafter, head size 256, every dimension rotated)."""
    from transformers import AutoConfig

    from dspark_ds.drafters.dspark.build import build_draft_config
    from dspark_ds.target import default_layer_ids

    cfg = parse_config("train", ["--config", str(RECIPES[0].parent / f"{algo}_qwen3_5_9b.yaml")])
    assert cfg.target.path == "Qwen/Qwen3.5-9B"
    target = AutoConfig.for_model("qwen3_5")
    text = target.get_text_config()
    assert (text.num_hidden_layers, text.hidden_size, text.head_dim) == (32, 4096, 256)
    assert text.layer_types.count("linear_attention") == 24
    assert cfg.target.layer_ids == default_layer_ids(text.num_hidden_layers)
    drafter = build_draft_config(
        target, target_layer_ids=cfg.target.layer_ids, mask_token_id=cfg.model.mask_token_id
    )
    assert drafter.target_model_type == "qwen3_5" and drafter.model_type == "qwen3"
    assert (drafter.hidden_size, drafter.head_dim, drafter.vocab_size) == (4096, 256, 248320)
    assert "partial_rotary_factor" not in drafter.rope_parameters


# recipes in the shape of a drafter published for their target (block size, layers, anchors,
# backbone): DeepSeek's V4 drafter, 3 of V4's own layers (vLLM's V4 DSpark builds
# n_mtp_layers or 3) drafting blocks of 5 (docs/drafters.md#deepseek-v4s-own-drafter)
PUBLISHED_SHAPES = {"dspark_deepseek_v4_flash": (5, 3, 512, "target")}
PAPER_RECIPES = [p for p in RECIPES if "tiny" not in p.stem and p.stem not in PUBLISHED_SHAPES]
# the tiny CPU recipes shrink the drafter; these fields say which variant it is, and must agree
VARIANT_FIELDS = (
    "kind",
    "markov_head_type",
    "confidence_head_alpha",
    "confidence_head_with_markov",
    "loss_decay_gamma",
    "ce_loss_alpha",
    "l1_loss_alpha",
    "step_loss_decay",
)


def _preset_of(path: Path) -> str:
    name = "eagle3" if "eagle3" in path.stem else path.stem.split("_")[0]
    return "dspark" if name == "tiny" else name  # tiny_cpu.yaml is the tiny DSpark


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.stem)
def test_paper_recipe_is_its_preset(path):
    name = _preset_of(path)
    assert name in PRESET_NAMES
    model = parse_config("train", ["--config", str(path)]).model
    got = {k: getattr(model, k) for k in preset_fields(name)}
    assert got == preset_fields(name)


# Kimi-K2.5's published text config where it differs from transformers 5.25's Kimi_K25Config
# text defaults (DeepSeek-V3's: vocabulary 129280, 256 experts, 128 heads, 3 dense layers): the
# values of moonshotai/Kimi-K2.5's config.json as NVIDIA TensorRT-LLM's auto_deploy Kimi-K2.5
# model copies them; `dspark-ds tune` ran on this config (docs/drafters.md#recipes-for-the-2026-targets)
KIMI_K25_TEXT = {
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
}


@pytest.mark.parametrize(
    ("stem", "family", "vocab", "layers"),
    [
        ("dspark_deepseek_v4_flash", "deepseek_v4", 129280, 43),
        ("dspark_glm5", "glm_moe_dsa", 154880, 78),
        ("dspark_deepseek_v32", "deepseek_v32", 129280, 61),
        ("dspark_kimi_k25", "kimi_k25", 163840, 61),
        ("dspark_minimax_m2", "minimax_m2", 200064, 62),
    ],
)
def test_the_2026_recipes_build_their_drafter_from_the_published_config(
    stem, family, vocab, layers
):
    """transformers' defaults are the published configs (DeepSeek-V4-Flash: 43 layers, hidden
    4096, vocabulary 129280; GLM-5: 78 layers, hidden 6144, vocabulary 154880; DeepSeek-V3.2: 61,
    7168, 129280; MiniMax-M2: 62, 3072, 200064), Kimi-K2.5's text config set to its published
    values (KIMI_K25_TEXT): the tapped ids follow default_layer_ids, the mask id lies in the
    vocabulary, and the drafter is DeepSeek's V4 layout (DSparkDraftModel) for V4, the
    Qwen3-style one for the others."""
    from transformers import AutoConfig

    from dspark_ds.drafters.dspark.build import build_draft_config
    from dspark_ds.target import default_layer_ids

    cfg = parse_config("train", ["--config", str(RECIPES[0].parent / f"{stem}.yaml")])
    target = AutoConfig.for_model(family)
    text = target.get_text_config()
    if family == "kimi_k25":
        for field, value in KIMI_K25_TEXT.items():
            setattr(text, field, value)
    assert (text.vocab_size, text.num_hidden_layers) == (vocab, layers)
    if family in ("deepseek_v32", "kimi_k25"):
        assert (text.hidden_size, text.n_routed_experts) == (7168, 384 if "kimi" in family else 256)
    if family == "minimax_m2":
        assert (text.hidden_size, text.num_local_experts) == (3072, 256)
    assert cfg.target.layer_ids == default_layer_ids(layers)
    assert 0 <= cfg.model.mask_token_id < vocab
    fields = {f: getattr(cfg.model, f) for f in ("num_draft_layers", "block_size", "backbone")}
    drafter = build_draft_config(
        target,
        target_layer_ids=cfg.target.layer_ids,
        mask_token_id=cfg.model.mask_token_id,
        **fields,
    )
    want = "DSparkDraftModel" if family == "deepseek_v4" else "Qwen3DSparkModel"
    assert drafter.architectures == [want] and drafter.target_model_type == family


@pytest.mark.parametrize("path", [p for p in RECIPES if "tiny" in p.stem], ids=lambda p: p.stem)
def test_tiny_recipe_is_a_smaller_preset(path):
    model = parse_config("train", ["--config", str(path)]).model
    want = preset(_preset_of(path))
    fields = [f for f in VARIANT_FIELDS if f in preset_fields(_preset_of(path))]
    assert fields and {f: getattr(model, f) for f in fields} == {
        f: getattr(want, f) for f in fields
    }


def test_presets_differ_where_the_paper_says():
    dspark, dflash, eagle3 = preset("dspark"), preset("dflash"), preset("eagle3")
    assert (dspark.markov_rank, dflash.markov_rank) == (256, 0)
    assert (dspark.ce_loss_alpha, dspark.l1_loss_alpha, dspark.confidence_head_alpha) == (
        0.1,
        0.9,
        1.0,
    )
    assert (dflash.ce_loss_alpha, dflash.l1_loss_alpha, dflash.confidence_head_alpha) == (
        1.0,
        0.0,
        0.0,
    )
    assert (eagle3.kind, eagle3.num_draft_layers, eagle3.ttt_length) == ("eagle3", 1, 7)
    # presets are copies: changing one never changes the next
    dspark.markov_rank = 3
    assert preset("dspark").markov_rank == 256
    for name in PRESET_NAMES:
        preset(name).validate()
