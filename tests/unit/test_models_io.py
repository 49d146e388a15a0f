"""Interchange directories (docs/checkpoint-format.md) and draft-config validation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

from dspark_ds.drafters import (
    build_draft_config,
    load_draft_model,
    register_auto_classes,
    save_draft_model,
)
from dspark_ds.errors import ConfigError

from helpers.drafters import DFLASH, MASK_ID, random_batch, tiny_drafter, tiny_qwen3_config


@pytest.mark.parametrize(
    "heads", [dict(markov_head_type="rnn"), DFLASH], ids=["dspark-rnn", "dflash"]
)
def test_save_load_round_trip_is_bit_exact(tmp_path, heads):
    model = tiny_drafter(**heads).eval()
    save_draft_model(model, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    for field in (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "num_anchors",
        "markov_rank",
        "enable_confidence_head",
        "confidence_head_with_markov",
    ):
        assert field in config, field
    loaded = load_draft_model(tmp_path / "d")
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    batch = random_batch(model)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    with torch.no_grad():
        assert torch.equal(
            model(**batch, generator=g()).draft_logits, loaded(**batch, generator=g()).draft_logits
        )
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad


def test_golden_checkpoint_resaves_to_the_same_weights(tmp_path, golden_dir):
    model = load_draft_model(golden_dir / "qwen3_vanilla" / "draft")
    save_draft_model(model, tmp_path / "d")
    ours = load_file(str(tmp_path / "d" / "model.safetensors"))
    ref = load_file(str(golden_dir / "qwen3_vanilla" / "draft" / "model.safetensors"))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    ref_cfg = json.loads((golden_dir / "qwen3_vanilla" / "draft" / "config.json").read_text())
    our_cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for key in (
        "architectures",
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "markov_rank",
        "markov_head_type",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
    ):
        assert our_cfg[key] == ref_cfg[key], key


def test_load_casts_dtype(tmp_path):
    save_draft_model(tiny_drafter(), tmp_path / "d")
    assert load_draft_model(tmp_path / "d", dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(target_layer_ids=[2, 1]), "target_layer_ids"),
        (dict(target_layer_ids=[0, 4]), "target_layer_ids"),
        (dict(target_layer_ids=[-2, 1]), "target_layer_ids"),
        (dict(target_layer_ids=[]), "target_layer_ids"),
        (dict(markov_rank=0, confidence_head_with_markov=True), "confidence_head_with_markov"),
        (dict(markov_rank=-1), "markov_rank"),
        (dict(markov_head_type="lstm"), "markov_head_type"),
        (dict(block_size=0), "block_size"),
        (dict(num_anchors=0), "num_anchors"),
        (dict(num_draft_layers=0), "num_draft_layers"),
        (dict(confidence_head_alpha=-1.0), "confidence_head_alpha"),
        (dict(mask_token_id=10_000), "mask_token_id"),
    ],
)
def test_bad_config_is_refused_naming_the_field(kwargs, field):
    base = dict(target_layer_ids=[0, 2], mask_token_id=MASK_ID)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        build_draft_config(tiny_qwen3_config(), **base)


def test_a_family_with_soft_capped_logits_is_refused_by_name():
    """Other families get the Qwen3-style drafter, whose logits are lm_head(h) alone."""
    cfg = tiny_qwen3_config()
    cfg.model_type = "llama"
    assert build_draft_config(cfg, target_layer_ids=[0], mask_token_id=1).model_type == "qwen3"
    cfg.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="^final_logit_softcapping: llama targets"):
        build_draft_config(cfg, target_layer_ids=[0], mask_token_id=1)


def test_broken_directory_is_refused(tmp_path):
    model = tiny_drafter()
    save_draft_model(model, tmp_path / "d")
    with pytest.raises(ConfigError, match="config.json"):
        load_draft_model(tmp_path / "nothing")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state.pop("fc.weight")
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_draft_model(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["architectures"] = ["Qwen3Mystery"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures"):
        load_draft_model(tmp_path / "d")


def test_embedding_and_head_come_from_the_target_and_stay_frozen():
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(tiny_qwen3_config())
    model = tiny_drafter()
    model.initialize_embeddings_and_head(target.model.embed_tokens.weight, target.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" not in trainable
    assert "fc.weight" in trainable and "markov_head.markov_w1.weight" in trainable
    with pytest.raises(ValueError, match="lm_head"):
        model.initialize_embeddings_and_head(target.model.embed_tokens.weight, torch.zeros(3, 3))


def test_written_files_get_the_normal_mode(tmp_path):
    # safetensors' save_file alone creates 0600 files: a serving job of another user could not
    # read the drafter
    import os
    import stat

    save_draft_model(tiny_drafter(), tmp_path / "d")
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        mode = stat.S_IMODE((tmp_path / "d" / name).stat().st_mode)
        assert mode == 0o666 & ~umask, (name, oct(mode))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_auto_classes_still_build_and_load_plain_models(tmp_path):
    # registering the drafters must not change what transformers does with anything but a
    # drafter directory: from_config of a config built in code (no `architectures`), a Gemma4
    # wrapper building its text model through AutoModel, save / load of a plain target
    from transformers import AutoModel, AutoModelForCausalLM, Gemma4ForConditionalGeneration

    from helpers.gemma4 import tiny_gemma4_target_config

    register_auto_classes()
    cfg = tiny_qwen3_config()
    assert cfg.architectures is None
    model = AutoModelForCausalLM.from_config(cfg)
    assert type(model) is Qwen3ForCausalLM
    assert type(AutoModel.from_config(cfg)).__name__ == "Qwen3Model"
    wrapper = Gemma4ForConditionalGeneration(tiny_gemma4_target_config())
    assert type(wrapper.model.language_model).__name__ == "Gemma4TextModel"
    model.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM"]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "plain")) is Qwen3ForCausalLM


@pytest.mark.parametrize("family", ["qwen3_vanilla", "gemma4_vanilla"])
def test_transformers_auto_classes_load_the_drafter(tmp_path, golden_dir, family):
    # config.json keeps the family's model_type (the interchange format); transformers would load
    # a plain causal LM from it and drop the drafter's heads as "unexpected"
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    register_auto_classes()
    src = golden_dir / family / "draft"
    want = load_draft_model(src)
    for auto in (AutoModelForCausalLM, AutoModel):
        model = auto.from_pretrained(src)
        assert type(model) is type(want), auto
        a, b = model.state_dict(), want.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bf16 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="device_map"):  # nothing ignored silently
        AutoModelForCausalLM.from_pretrained(src, device_map={"": "cpu"})
    # the config still reads as the family's own (what DeepSpec / SGLang / vLLM rely on), and a
    # plain target of that family still loads as the plain causal LM
    assert (
        AutoConfig.from_pretrained(src).model_type
        == json.loads((src / "config.json").read_text())["model_type"]
    )
    if family == "qwen3_vanilla":
        target = Qwen3ForCausalLM(tiny_qwen3_config())
        target.save_pretrained(tmp_path / "target")
        assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "target")) is Qwen3ForCausalLM
