"""The large MoE targets of 2026: DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention), Kimi-K2.5
(a vision-language checkpoint whose text model is the target), MiniMax-M2 and DeepSeek-V4
(hyper-connections, compressed attention), as tiny checkpoints made by transformers' own classes
(`helpers.moe_targets`). What is pinned:

- the drafter is the Qwen3-style one, sized from each (DeepSeek-V4: its `main` RoPE);
- the tapped features are the target's hidden states (DeepSeek-V4: the mean of its residual
  streams), its logits lm_head(final state), and every parameter read tensor by tensor (ZeRO-3)
  equals from_pretrained's; Kimi-K2.5's target is its text model alone, with the whole model's
  logits on text;
- greedy speculative decoding equals the target's greedy decoding token for token, one row and
  batched (the sparse-attention indexer's keys cropped and moved with the KV cache), and T = 1
  sampling has the target's distribution (chi-square);
- DeepSeek-V4: its compressed layers' windows, compressor buffers, entries and counts after a
  rolled-back round equal a cache's that saw the kept tokens only (and without the rollback
  they do not); greedy and T = 1 decoding lossless one row at a time and batched (a cache per
  row, eval/row_caches.py; rows sharing one cache, or not rolled back, are not lossless).

Training: `tests/multiprocess/test_moe_targets_train.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dspark_ds.drafters import build_draft_config
from dspark_ds.drafters.io import TARGET_ARCHITECTURES
from dspark_ds.errors import ConfigError
from dspark_ds.eval import padded
from dspark_ds.eval.batched import batched_generate
from dspark_ds.eval.compressed import CompressedState
from dspark_ds.eval.recurrent import check_recurrent_target, is_recurrent
from dspark_ds.eval.target_step import TargetDecoder
from dspark_ds.target import TargetConfig, load_causal_lm, load_target
from dspark_ds.target_checkpoint import causal_lm_config
from dspark_ds.target_weights import TargetWeights

from helpers.evaluation import (
    check_greedy_rounds,
    check_sampled_distribution,
    decoding_pairs,
    decoding_prompts,
    greedy_reference,
    rolled_back_and_clean,
)
from helpers.moe_targets import MOE_TARGETS, build_tiny_moe_target, tiny_moe_model
from helpers.tiny_models import (
    assert_reads_like_from_pretrained,
    assert_taps_are_hidden_states,
    targets_by_family,
)

FAMILIES = list(MOE_TARGETS)
RECIPES = Path(__file__).parents[2] / "dspark_ds" / "recipes"
KV_ONLY = ["deepseek_v32", "glm_moe_dsa", "kimi_k25", "minimax_m2"]  # no compressed attention
DECODED = [*KV_ONLY, "deepseek_v4"]  # one row and batched
VOCAB = 16


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory):
    return targets_by_family(tmp_path_factory, "moe_targets", build_tiny_moe_target, FAMILIES)


# ---- the drafter, the features, the checkpoint --------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafter_is_sized_from_the_target(family, target_dirs):
    whole = AutoConfig.from_pretrained(target_dirs[family])
    text = causal_lm_config(whole) if family == "kimi_k25" else whole
    cfg = build_draft_config(whole, target_layer_ids=[-1, 0, 2], mask_token_id=3)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["Qwen3DSparkModel"]
    assert (cfg.target_model_type, cfg.target_text_model_type) == (family, text.model_type)
    assert cfg.hidden_size == 64 and cfg.num_target_layers == 4
    assert cfg.num_attention_heads == 4 and cfg.head_dim == text.head_dim
    rope = text.rope_parameters
    if family == "deepseek_v4":  # {"main", "compress"}: the sliding-window attention's
        assert set(rope) == {"main", "compress"}
        rope = rope["main"]
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    assert cfg.rope_parameters == rope


@pytest.mark.parametrize("family", FAMILIES)
def test_features_head_and_tensor_by_tensor_reads(family, target_dirs):
    """Hooks = output_hidden_states (each layer's residual streams averaged), check_head passed
    on load, every parameter of the reader (ZeRO-3's) = from_pretrained's."""
    path = target_dirs[family]
    target, ids, out = assert_taps_are_hidden_states(path)
    if family == "deepseek_v4":  # 2 residual streams; the embedding in each
        assert out.hidden_states[1].shape == (2, 12, 2, 64)
        embedded = target.model.get_input_embeddings()(ids)
        assert torch.equal(out.hidden_states[0].mean(dim=2), embedded)
    assert_reads_like_from_pretrained(path, target.model.state_dict())


def test_kimi_k25_is_its_text_model_alone(target_dirs):
    """The vision-language checkpoint's target: DeepSeek-V3 with the whole model's logits on
    text, no vision weight loaded or read."""
    from transformers import Kimi_K25ForConditionalGeneration

    path = target_dirs["kimi_k25"]
    target = load_target(TargetConfig(path=path, layer_ids=[0, 2], dtype="float32"), "cpu")
    assert type(target.model).__name__ == "DeepseekV3ForCausalLM"
    assert not any("vision" in n or "projector" in n for n in target.model.state_dict())
    read = {name for name, _ in TargetWeights(path).sources(target.model)}
    assert read == set(target.model.state_dict())
    whole = Kimi_K25ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(4, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, whole(input_ids=ids).logits)


# ---- lossless decoding ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return decoding_pairs(tiny_moe_model, DECODED, VOCAB)


NEW = 10


@pytest.mark.parametrize("family", DECODED)
def test_greedy_speculative_decoding_equals_the_targets_greedy_generate(family, models):
    """One row (full gamma, threshold) and batched with prompts of 3, 9 and 6 tokens entering
    and leaving (full gamma, threshold, scheduler): drafts rejected in most rounds, some kept, so
    caches are cut back and rows shifted every round, the rows at different positions
    (DeepSeek-V4: a cache per row)."""
    target, drafter = models[family]
    prompts = decoding_prompts(VOCAB)
    want = [greedy_reference(target, p, NEW) for p in prompts]
    proposed, accepted = check_greedy_rounds(target, drafter, prompts, want, NEW)
    assert 0 < accepted < proposed, (accepted, proposed)
    for r in batched_generate(target, None, prompts, batch_size=2, max_new_tokens=NEW):
        assert r.output_ids.tolist() == want[r.index].tolist()  # the target alone, batched


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_a_rejected_draft_leaves_no_indexer_key_behind(family, models):
    """After a round whose drafts were all rejected, the cache (MLA keys and the indexer's keys)
    equals one that only saw the kept tokens."""
    target, _ = models[family]
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rolled, clean = rolled_back_and_clean(target, ids, 8, 10, [3, 1, 4])
        indexed = 0
        for mine, theirs in zip(rolled.cache.layers, clean.cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys)
            if getattr(theirs, "is_indexer_initialized", False):
                assert mine.indexer_keys.shape[1] == 10
                torch.testing.assert_close(mine.indexer_keys, theirs.indexer_keys)
                indexed += 1
        assert indexed >= 3  # (GLM-5: one layer reuses the previous layer's selection)
        torch.testing.assert_close(
            rolled.forward(ids[:, 10:]).logits_LV, target(ids).logits[0, 10:], rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sampled_speculative_decoding_has_the_targets_distribution(family):
    """T = 1, batched: x1 from the prefill, (x2, x3) from verification rounds with rows cut back
    to different lengths in one batch."""
    target = tiny_moe_model(family, 8, seed=0)
    with torch.no_grad():  # x8 is too sharp for a chi-square over 8 tokens: x2 in all
        target.get_output_embeddings().weight.div_(4.0)
    prompt = torch.tensor([[1, 2, 3, 5, 6]])
    check_sampled_distribution(target, prompt, 300, 30, batch_size=50)


def test_the_family_table_says_what_trains_and_decodes():
    """docs/drafters.md's table of these families: each trains and decodes losslessly (one row
    and batched, above)."""
    text = (Path(__file__).parents[2] / "docs" / "drafters.md").read_text()
    for family in FAMILIES:
        row = next(line for line in text.splitlines() if f"| `{family}` |" in line)
        cells = [cell.strip() for cell in row.split("|")]
        assert cells[3] == "✓", family
        assert cells[4] == "✓ lossless", family
        # `model.backbone: target`: DeepSeek-V4's own drafter, the others refused by name
        own = family in TARGET_ARCHITECTURES["dspark"]
        assert cells[6].startswith("✓" if own else "refused by name"), family
        config = tiny_moe_model(family, VOCAB).config
        if own:
            build_draft_config(config, target_layer_ids=[0], mask_token_id=1, backbone="target")
        else:
            with pytest.raises(ConfigError, match="^backbone: target: the dspark drafter has no"):
                build_draft_config(config, target_layer_ids=[0], mask_token_id=1, backbone="target")
        recipe = cells[7].strip("`")
        assert recipe == "—" or (RECIPES / f"{recipe}.yaml").exists(), family


def _compressed_states(decoder: TargetDecoder) -> list[torch.Tensor]:
    """Every tensor DeepSeek-V4's compressed layers keep: window, buffers, entries, overlap."""
    out = []
    for layer in decoder.cache.layers:
        if hasattr(layer, "compressed_kv"):
            out.append(layer.keys)
            for name in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
                out += [t for t in getattr(layer, name, {}).values() if t is not None]
            out.append(torch.tensor(list(layer.entry_count.values())))
    assert len(out) > 8
    return out


def _v4_rolled_back(target, ids) -> tuple[TargetDecoder, TargetDecoder]:
    """A decoder that verified junk after ids[:, 8:11] and kept the 3 real tokens (the sliding
    window of 8 full, a compressed-sparse window of 2 and a heavily-compressed one of 4 closed
    with junk in them), and one that only saw ids[:, :11]."""
    return rolled_back_and_clean(target, ids, 8, 11, [3, 1, 4, 1, 5])


def test_deepseek_v4s_compressed_attention_is_rolled_back_exactly(models, monkeypatch):
    """After a round with rejected drafts, the compressed layers' windows, compressor buffers,
    entries, counts and overlaps equal those of a cache that saw the kept tokens only, and the
    next forward equals the full forward; without the rollback they do not."""
    target, _ = models["deepseek_v4"]
    ids = torch.randint(0, VOCAB, (1, 15), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rolled, clean = _v4_rolled_back(target, ids)
        for mine, theirs in zip(_compressed_states(rolled), _compressed_states(clean), strict=True):
            torch.testing.assert_close(mine, theirs)
        torch.testing.assert_close(
            rolled.forward(ids[:, 11:]).logits_LV, target(ids).logits[0, 11:], rtol=1e-5, atol=1e-5
        )
        monkeypatch.setattr(CompressedState, "rollback", lambda self, cache, keep, n: None)
        stale, clean = _v4_rolled_back(target, ids)
        stale_states, clean_states = _compressed_states(stale), _compressed_states(clean)
        assert len(stale_states) != len(clean_states) or any(
            a.shape != b.shape or not torch.equal(a, b) for a, b in zip(stale_states, clean_states)
        )


def test_which_families_keep_a_state_a_crop_does_not_roll_back():
    """DeepSeek-V4's compressed attention reads as recurrent and is rolled back by its own
    replay, not refused; the others keep a KV cache (and indexer keys) alone."""
    config = tiny_moe_model("deepseek_v4", VOCAB).config
    assert is_recurrent(config)
    check_recurrent_target(config)
    for family in KV_ONLY:
        cfg = tiny_moe_model(family, VOCAB).config
        assert not is_recurrent(cfg), family
        check_recurrent_target(cfg)


@pytest.mark.parametrize("batch_size", [None, 40])
def test_sampled_decoding_has_deepseek_v4s_distribution(batch_size):
    """T = 1, one row at a time and batched (a cache per row): x1 from the prefill, (x2, x3)
    from verification rounds, the compressed layers rolled back after each, batched rows cut
    back to different lengths and so at different positions."""
    target = tiny_moe_model("deepseek_v4", 8, seed=0)
    with torch.no_grad():  # x8 is too sharp for a chi-square over 8 tokens: x2 in all
        target.get_output_embeddings().weight.div_(4.0)
    prompt = torch.tensor([[1, 2, 3, 5, 6, 1, 2]])
    check_sampled_distribution(target, prompt, 200, 30, batch_size)


def test_batched_deepseek_v4_needs_a_cache_per_row_rolled_back(models, monkeypatch):
    """Without the replay of each row's compressed layers, or with the rows in one shared cache
    (eval/padded.py's layout), batched decoding does not give the target's greedy text."""
    target, drafter = models["deepseek_v4"]
    prompts = decoding_prompts(VOCAB)
    want = [greedy_reference(target, p, NEW, with_generate=False).tolist() for p in prompts]

    def batched():
        try:
            results = batched_generate(target, drafter, prompts, batch_size=2, max_new_tokens=NEW)
        except RuntimeError as err:  # (a shape error: the compressor's buffers, the windows)
            return str(err)
        return [r.output_ids.tolist() for r in results]

    assert batched() == want
    with monkeypatch.context() as patch:
        patch.setattr(CompressedState, "replay", lambda self, cache, recording, keep, n: None)
        assert batched() != want
    monkeypatch.setattr(padded, "needs_row_caches", lambda config: False)
    assert batched() != want


def test_an_attention_kernel_the_family_lacks_is_one_line(target_dirs):
    # transformers has no sdpa for DeepSeek-V4: its default (None) loads it, a named one is refused
    path = target_dirs["deepseek_v4"]
    with pytest.raises(ConfigError, match="attn_implementation: the deepseek_v4 target .* 'sdpa'"):
        load_causal_lm(TargetConfig(path=path, dtype="float32", attn_implementation="sdpa"))
    assert load_causal_lm(TargetConfig(path=path, dtype="float32")).config.model_type == (
        "deepseek_v4"
    )


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_the_tuners_narrow_copy_of_an_mla_target_runs(family):
    """`dspark-ds tune` times its host work on a narrow copy of the target (tune/workload.py):
    MLA's rope part is narrowed with the head size, so the copy runs a forward."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.tune.workload import NARROW, narrow_config

    config = narrow_config(tiny_moe_model(family, VOCAB).config)
    assert config.qk_rope_head_dim == NARROW["head_dim"]
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        logits = model(torch.randint(0, NARROW["vocab"], (1, 6))).logits
    assert logits.shape == (1, 6, NARROW["vocab"]) and torch.isfinite(logits).all()
