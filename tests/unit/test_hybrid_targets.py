"""Hybrid targets (Gated DeltaNet / Mamba2 layers beside full attention): lossless decoding.

Every family of `helpers.tiny_models.HYBRID_FAMILIES` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
Granite-4.0-H, Falcon-H1) as a tiny random model made by transformers' own classes, its lm_head
sharpened x8; a 16-token vocabulary so that random drafts are accepted now and then (kept
lengths 1, 2, ...) and rejected in most rounds. What is pinned:

- after a rolled-back round the recurrent and convolution states equal the states of a cache
  that only ever saw the kept tokens, and without the rollback they do not (the stale state);
- greedy speculative output equals the target's greedy decoding (a full forward per token, and
  the target's own `generate`, which equals it except on the Mamba2 hybrids) token for token, at
  batch 1 (full gamma, confidence threshold) and batched (full gamma, threshold, scheduler);
- T = 1: batched speculative sampling has each family's exact distribution (chi-square);
- an unsupported recurrent family is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from dspark_ds.errors import ConfigError
from dspark_ds.eval import recurrent
from dspark_ds.eval.batched import batched_generate
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.eval.recurrent import RecurrentState, check_recurrent_target, is_recurrent
from dspark_ds.eval.target_step import TargetDecoder

from helpers.evaluation import (
    check_greedy_rounds,
    check_sampled_distribution,
    decoding_pairs,
    decoding_prompts,
    greedy_reference,
    random_drafter,
    rolled_back_and_clean,
)
from helpers.gemma4 import greedy_without_cache
from helpers.tiny_models import (
    HYBRID_FAMILIES,
    assert_reads_like_from_pretrained,
    assert_taps_are_hidden_states,
    build_tiny_hybrid_target,
    hybrid_config,
    targets_by_family,
    tiny_hybrid_model,
)

VOCAB = 16
FAMILIES = list(HYBRID_FAMILIES)


@pytest.fixture(scope="module")
def models():
    return decoding_pairs(tiny_hybrid_model, FAMILIES, VOCAB)


def _states(decoder: TargetDecoder) -> list[torch.Tensor]:
    out = []
    for layer in decoder.cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
    assert out
    return out


def _relative_error(a: TargetDecoder, b: TargetDecoder) -> float:
    """The largest state difference relative to the state's largest entry, over the layers."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(_states(a), _states(b)))


def _rolled_back(target, ids: torch.Tensor) -> tuple[TargetDecoder, TargetDecoder]:
    """A decoder that verified junk after ids[:, 8:10] and kept the 2 real tokens, and one that
    only ever saw ids[:, :10]."""
    return rolled_back_and_clean(target, ids, 8, 10, [3, 1, 4])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rolled_back_state_is_the_state_after_the_kept_tokens(family, models, monkeypatch):
    target, _ = models[family]
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rolled, clean = _rolled_back(target, ids)
        assert _relative_error(rolled, clean) < 1e-4
        torch.testing.assert_close(
            rolled.forward(ids[:, 10:]).logits_LV, target(ids).logits[0, 10:], rtol=1e-5, atol=1e-5
        )
        # the stale state: without the rollback the junk stays folded into the state
        monkeypatch.setattr(RecurrentState, "rollback", lambda self, cache, keep, n: None)
        stale, clean = _rolled_back(target, ids)
        assert _relative_error(stale, clean) > 1e-2


NEW = 10


# NOTE: transformers 5.24's own `generate` on the tiny Mamba2 hybrids (Granite-4.0-H, Falcon-H1)
# differs from the model's full forward (Granite: 2 of these 3 prompts, by logit margins of 0.27
# and more, so not a near-tie): its single-token decode path. The reference is the full-forward
# greedy loop, which `generate` equals for the Gated DeltaNet families.
GENERATE_DIFFERS = {"granitemoehybrid", "falcon_h1"}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_decoding_equals_the_targets_greedy_generate(family, models):
    """Batch 1 (full gamma, threshold) and batched with queued prompts entering and leaving
    (full gamma, threshold, scheduler); drafts rejected in most rounds, some kept."""
    target, drafter = models[family]
    prompts = decoding_prompts(VOCAB)
    want = [greedy_reference(target, p, NEW, family not in GENERATE_DIFFERS) for p in prompts]
    proposed, accepted = check_greedy_rounds(target, drafter, prompts, want, NEW)
    assert 0 < accepted < proposed / 2, (accepted, proposed)


# ---- T = 1 ------------------------------------------------------------------------------------

SAMPLES = 400


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_speculative_decoding_has_the_hybrid_targets_distribution(family):
    """x1 from the prefill, (x2, x3) from verification rounds with rows rolled back to
    different lengths in one batch."""
    target = tiny_hybrid_model(family, 8, seed=0)
    with torch.no_grad():  # x8 is too sharp for a chi-square over 8 tokens: x4 in all
        target.get_output_embeddings().weight.div_(2.0)
    prompt = torch.tensor([[1, 2, 3, 5]])
    check_sampled_distribution(target, prompt, SAMPLES, 0.1 * SAMPLES, batch_size=50)


# ---- refused by name --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("mamba2", dict(num_heads=4, head_dim=16, hidden_size=32, state_size=8)),
        ("jamba", dict(hidden_size=32, num_attention_heads=4)),
        ("lfm2", dict(hidden_size=32, num_attention_heads=4)),
    ],
)
def test_a_recurrent_family_that_cannot_be_rolled_back_is_refused_by_name(family, fields):
    cfg = AutoConfig.for_model(family, vocab_size=64, num_hidden_layers=2, **fields)
    with pytest.raises(ConfigError, match=f"^{family}: this target keeps a recurrent"):
        check_recurrent_target(cfg)


def test_kv_cache_families_are_not_recurrent():
    from helpers.tiny_models import FAMILIES as KV_FAMILIES
    from helpers.tiny_models import family_config

    for family in KV_FAMILIES:
        assert not is_recurrent(family_config(family, 64)), family
    for family in FAMILIES:
        assert is_recurrent(tiny_hybrid_model(family, VOCAB).config), family


def test_decoding_with_the_stale_state_is_not_lossless(monkeypatch):
    """The rollback removed (the rejected drafts left in the recurrent state): speculative
    output leaves the target's greedy text, at batch 1 and batched (the tiny tokenizer's
    vocabulary, where a stale state flips greedy tokens sooner than in 16)."""
    target = tiny_hybrid_model("qwen3_5_text", 384)
    drafter = random_drafter(target, layer_ids=(0, 2))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 300, (1, n), generator=g) for n in (10, 7)]
    want = [greedy_without_cache(target, p, 16, set()).tolist() for p in prompts]
    got = [speculative_generate(target, drafter, p, max_new_tokens=16)[0].tolist() for p in prompts]
    assert got == want
    # (the convolution windows still padded to the kernel, as rows entering a batch need)
    monkeypatch.setattr(
        RecurrentState, "rollback", lambda self, cache, keep, n: recurrent._pad_conv_windows(cache)
    )
    one_row = [
        speculative_generate(target, drafter, p, max_new_tokens=16)[0].tolist() for p in prompts
    ]
    batched = batched_generate(target, drafter, prompts, batch_size=2, max_new_tokens=16)
    assert one_row != want
    assert [r.output_ids.tolist() for r in batched] != want


# ---- the drafter, the features, the checkpoint ------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    return targets_by_family(tmp_path_factory, "hybrids", build_tiny_hybrid_target, FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafter_is_sized_from_the_hybrids_config(family, hybrid_dirs):
    """Head size and RoPE from the target's attention layers (Qwen3.5 / Qwen3-Next: head_dim of
    their own, partial RoPE dropped: every draft head dimension rotates); Qwen3.5-MoE has no
    dense MLP width: the drafter's is a token's routed experts plus the shared one."""
    from dspark_ds.drafters.dspark.build import build_draft_config

    target_cfg = AutoConfig.from_pretrained(hybrid_dirs[family])
    cfg = build_draft_config(target_cfg, target_layer_ids=[-1, 0, 2], mask_token_id=3)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["Qwen3DSparkModel"]
    assert cfg.target_text_model_type == family and cfg.num_target_layers == 4
    assert cfg.hidden_size == 32 and cfg.vocab_size == target_cfg.vocab_size
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.head_dim == (getattr(target_cfg, "head_dim", None) or 8)
    rope = dict(target_cfg.rope_parameters)
    assert rope.pop("partial_rotary_factor", None) == (0.25 if "qwen3" in family else None)
    assert cfg.rope_parameters == rope
    if family == "qwen3_5_moe_text":
        assert not hasattr(target_cfg, "intermediate_size")
        assert cfg.intermediate_size == 32 * 2 + 32
    else:
        assert cfg.intermediate_size == target_cfg.intermediate_size


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_features_and_checkpoint_reads(family, hybrid_dirs):
    """The hooks' features equal output_hidden_states (check_head passed on load), and every
    parameter read tensor by tensor (what ZeRO-3 ranks read their partitions from; MoE experts
    fused by transformers' converters) equals from_pretrained's."""
    path = hybrid_dirs[family]
    target, _, _ = assert_taps_are_hidden_states(path)
    assert_reads_like_from_pretrained(path, target.model.state_dict())


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_an_eagle3_chain_on_a_hybrid_is_lossless(family, models):
    """The rollback is the target's: an Eagle3 drafter's chains verify the same way."""
    from dspark_ds.drafters.eagle3.build import build_eagle3_config
    from dspark_ds.drafters.io import build_draft_model

    target, _ = models[family]
    torch.manual_seed(2)
    drafter = build_draft_model(
        build_eagle3_config(target.config, target_layer_ids=[0, 2], ttt_length=3)
    )
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    drafter.eval()
    prompts = decoding_prompts(VOCAB)
    want = [greedy_without_cache(target, p, NEW, set()).tolist() for p in prompts]
    got = [
        speculative_generate(target, drafter, p, max_new_tokens=NEW)[0].tolist() for p in prompts
    ]
    assert got == want
    results = batched_generate(target, drafter, prompts, batch_size=2, max_new_tokens=NEW)
    assert [r.output_ids.tolist() for r in results] == want


def test_a_multimodal_qwen3_5_checkpoint_is_read_as_its_text_target(tmp_path):
    """Published Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration` (a vision tower,
    the text model under `model.language_model.`): the target is its text model, with the
    whole model's logits, and the tensor-by-tensor reader (ZeRO-3) finds every parameter."""
    from transformers import Qwen3_5ForConditionalGeneration

    from dspark_ds.target import TargetConfig, load_target

    text = hybrid_config("qwen3_5_text", 384).to_dict()
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    cfg = AutoConfig.for_model(
        "qwen3_5", text_config=text, vision_config=vision, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    whole = Qwen3_5ForConditionalGeneration(cfg).eval()
    whole.save_pretrained(tmp_path)
    target = load_target(TargetConfig(path=str(tmp_path), layer_ids=[0, 2], dtype="float32"), "cpu")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(4, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, whole(input_ids=ids).logits)
    assert_reads_like_from_pretrained(tmp_path, target.model.state_dict())
