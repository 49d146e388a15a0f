"""Targets of other families than Qwen3 and Gemma4: the Qwen3-style drafter sized from them, the
features tapped from them, their checkpoints read tensor by tensor, lossless decoding, and what
is refused by name.

Every family of `helpers.tiny_models.FAMILIES` (Llama, Qwen2, Mistral with tied embeddings,
Qwen3-MoE, gpt-oss, DeepSeek-V3) as a tiny random checkpoint saved with `save_pretrained` (built
once for the module). The multi-process parts (ZeRO-3 loading, training, host memory) are in
`tests/e2e/test_target_families_e2e.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dspark_ds.drafters import load_draft_model, register_auto_classes, save_draft_model
from dspark_ds.drafters.dspark.build import build_draft_config
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.io import build_draft_model
from dspark_ds.errors import ConfigError
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.target import FrozenTarget, TargetConfig
from dspark_ds.target_weights import StoredTensor, read_header

from helpers.drafters import tiny_dspark_config, with_target_weights
from helpers.gemma4 import greedy_without_cache
from helpers.tiny_models import (
    FAMILIES,
    assert_reads_like_from_pretrained,
    assert_taps_are_hidden_states,
    build_tiny_family_target,
    targets_by_family,
    tiny_widths,
)

LAYER_IDS = [-1, 0, 2]  # of 4 layers: the embedding output, two decoder layers


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return targets_by_family(tmp_path_factory, "families", build_tiny_family_target, FAMILIES)


def _load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _random_drafter(target, kind: str, seed: int = 0):
    """A drafter of `kind` for `target` with weights large enough that drafts vary."""
    if kind == "dspark":
        cfg = tiny_dspark_config(target.config, LAYER_IDS)
    else:
        cfg = build_eagle3_config(target.config, target_layer_ids=LAYER_IDS, ttt_length=3)
    torch.manual_seed(seed)
    return with_target_weights(build_draft_model(cfg), target)


# ---- the drafter a family gets ---------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_drafter_is_qwen3_style_and_sized_from_the_target(family, family_dirs, tmp_path):
    target_cfg = AutoConfig.from_pretrained(family_dirs[family])
    rope = dict(target_cfg.rope_parameters)
    rope.pop("partial_rotary_factor", None)
    for kind, architecture in (("dspark", "Qwen3DSparkModel"), ("eagle3", "Qwen3Eagle3Model")):
        if kind == "dspark":
            cfg = build_draft_config(target_cfg, target_layer_ids=LAYER_IDS, mask_token_id=3)
        else:
            cfg = build_eagle3_config(target_cfg, target_layer_ids=LAYER_IDS)
        assert cfg.model_type == "qwen3" and cfg.architectures == [architecture]
        assert (cfg.target_model_type, cfg.target_text_model_type) == (family, family)
        heads = target_cfg.num_attention_heads
        assert cfg.hidden_size == target_cfg.hidden_size == 32
        assert cfg.vocab_size == target_cfg.vocab_size
        assert cfg.num_attention_heads == heads
        assert cfg.num_key_value_heads == target_cfg.num_key_value_heads
        assert cfg.head_dim == (getattr(target_cfg, "head_dim", None) or 32 // heads)
        assert cfg.intermediate_size == target_cfg.intermediate_size
        assert cfg.rms_norm_eps == target_cfg.rms_norm_eps
        assert cfg.rope_parameters == rope  # theta and scaling (gpt-oss: YaRN)
        assert cfg.num_target_layers == 4 and cfg.target_layer_ids == LAYER_IDS
        assert not cfg.tie_word_embeddings
    # the interchange directory names the family and loads back as the same drafter
    target = _load(family_dirs[family])
    drafter = _random_drafter(target, "dspark")
    save_draft_model(drafter, tmp_path / "d")
    loaded = load_draft_model(tmp_path / "d")
    assert loaded.config.target_model_type == family
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    register_auto_classes()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "d")  # registered architectures
    assert type(auto) is type(drafter)


# ---- features and head ----------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tapped_features_are_the_targets_hidden_states(family, family_dirs):
    """The hooks give what output_hidden_states gives (id i = hidden_states[i + 1], the last
    one normed), and the logits are lm_head(final state): what the drafter shares."""
    target, _, out = assert_taps_are_hidden_states(family_dirs[family])
    last = out.hidden_states[4]
    torch.testing.assert_close(out.logits, target.model.get_output_embeddings()(last))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_read_tensor_by_tensor_equals_from_pretrained(family, family_dirs):
    """`TargetWeights` (what each ZeRO-3 rank reads its partitions from), MoE experts fused by
    transformers' converters, gives every parameter from_pretrained gives."""
    path = family_dirs[family]
    assert_reads_like_from_pretrained(path, _load(path).state_dict())


def test_shared_weights_are_read_by_the_models_own_names(family_dirs, tmp_path):
    """What offline training and the export copy into the drafter: the embedding and lm_head,
    whatever the family names them (GPT-2: `transformer.wte`, tied)."""
    from dspark_ds.target import target_shared_weights

    gpt2 = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    for path in [*family_dirs.values(), str(tmp_path / "gpt2")]:
        model = _load(path)
        embed, head = target_shared_weights(path)
        assert torch.equal(embed, model.get_input_embeddings().weight), path
        assert torch.equal(head, model.get_output_embeddings().weight), path


def test_stored_tensor_ranges_and_a_truncated_file(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(5, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    stored = read_header(tmp_path / "x.safetensors")
    assert torch.equal(stored["a"].full(), tensors["a"])
    assert torch.equal(stored["a"].read(5, 11), torch.arange(5.0, 11.0))
    assert stored["a"].read(4, 4).numel() == 0
    assert torch.equal(stored["b"].read(1, 3), tensors["b"][1:3])
    cut = StoredTensor(stored["a"].file, torch.float32, (100,), stored["a"].offset)
    with pytest.raises(ConfigError, match="truncated"):
        cut.read(0, 100)


# ---- lossless decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_speculative_decoding_equals_greedy_target(family, family_dirs):
    target = _load(family_dirs[family])
    ids = torch.randint(4, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    want = greedy_without_cache(target, ids, 16, set())
    for kind in ("dspark", "eagle3"):
        drafter = _random_drafter(target, kind)
        got, stats = speculative_generate(target, drafter, ids, max_new_tokens=16, temperature=0)
        assert torch.equal(got, want), kind
        assert stats.rounds >= 1


# ---- refused by name ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("gemma2", "final_logit_softcapping", 30.0),
        ("cohere", "logit_scale", 0.0625),
        ("granite", "logits_scaling", 8.0),
    ],
)
def test_a_family_with_other_logits_is_refused_naming_the_field(family, field, value):
    cfg = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        **{field: value},
    )
    with pytest.raises(ConfigError, match=f"^{field}: {family} targets with {field}={value}"):
        build_draft_config(cfg, target_layer_ids=[0], mask_token_id=1)


def test_an_encoder_decoder_is_refused():
    cfg = AutoConfig.for_model("t5", vocab_size=64, d_model=32, num_layers=2, num_heads=4)
    with pytest.raises(ConfigError, match="^is_encoder_decoder: t5"):
        build_draft_config(cfg, target_layer_ids=[0], mask_token_id=1)


def test_a_head_the_config_does_not_announce_is_refused_when_the_target_runs(family_dirs):
    """check_head compares the model's logits with lm_head(final state) on a few tokens."""
    model = _load(family_dirs["llama"])
    target = FrozenTarget(model, [0])
    target.check_head()  # plain
    plain_forward = model.forward

    def scaled_logits(*args, **kwargs):  # a family scaling its logits after the lm_head
        out = plain_forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = scaled_logits
    with pytest.raises(ConfigError, match="llama target's logits differ from lm_head"):
        target.check_head()
    phi_cfg = AutoConfig.for_model("phi", **tiny_widths(64, num_hidden_layers=2))
    phi = AutoModelForCausalLM.from_config(phi_cfg)
    with pytest.raises(ConfigError, match="phi target's lm_head has a bias"):
        FrozenTarget(phi, [0]).check_head()


def test_train_names_the_target_option_for_a_refused_family(tmp_path, capsys):
    from dspark_ds.cli import main as cli_main

    cfg = AutoConfig.for_model(
        "gemma2", **tiny_widths(64, num_hidden_layers=2, final_logit_softcapping=30.0)
    )
    cfg.save_pretrained(tmp_path / "gemma2")
    argv = ["train", "--config", "dspark_ds/recipes/tiny_cpu.yaml"]
    argv += ["--target.path", str(tmp_path / "gemma2"), "--model.mask_token_id", "1"]
    argv += [f"--output_dir={tmp_path / 'runs'}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "target.path: final_logit_softcapping: gemma2 targets" in err
    assert len(err.strip().splitlines()) == 1


def test_zero3_refuses_a_quantized_checkpoint_before_building_anything(family_dirs, tmp_path):
    """Its weights need transformers' quantizer, which a partition-wise read bypasses."""
    from dspark_ds.engine.target import load_partitioned_target

    cfg = AutoConfig.from_pretrained(family_dirs["gpt_oss"])
    cfg.quantization_config = {"quant_method": "mxfp4"}
    cfg.save_pretrained(tmp_path / "quantized")
    with pytest.raises(ConfigError, match="quantized checkpoint .quantization_config: mxfp4"):
        load_partitioned_target(TargetConfig(path=str(tmp_path / "quantized")), {})
