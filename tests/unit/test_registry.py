"""The drafter kinds: one per name, found by name or from a model; each kind honours the `perf`
section or refuses an option by name; the kind's training step equals the direct call."""

from __future__ import annotations

from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch

from dspark_ds.drafters.common.memory import StepShape
from dspark_ds.drafters.dspark.loss import compute_dspark_loss
from dspark_ds.drafters.dspark.step import sample_anchors
from dspark_ds.drafters.eagle3 import loss as eagle3_loss
from dspark_ds.drafters.io import build_draft_model, build_eagle3_config
from dspark_ds.drafters.kind import StepContext
from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.presets import PRESET_NAMES, preset
from dspark_ds.drafters.registry import KINDS, get_kind, kind_of

from helpers.drafters import random_batch, tiny_drafter, tiny_qwen3_config

LAYER_IDS = [-1, 1, 2]


def tiny_eagle3(ttt_length: int = 3):
    cfg = build_eagle3_config(
        tiny_qwen3_config(), target_layer_ids=LAYER_IDS, ttt_length=ttt_length
    )
    torch.manual_seed(0)
    model = build_draft_model(cfg)
    model.freeze_shared()
    return model


def test_kinds_by_name_and_by_model():
    assert list(KINDS) == ["dspark", "eagle3"]
    assert kind_of(tiny_drafter()) is get_kind("dspark")
    # a DeepSpeed engine is looked through (`.module`)
    assert kind_of(SimpleNamespace(module=tiny_eagle3())) is get_kind("eagle3")
    with pytest.raises(ValueError, match="model.kind"):
        get_kind("medusa")
    with pytest.raises(ValueError, match="drafter"):
        kind_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("name", "architecture"), [("dspark", "Qwen3DSparkModel"), ("eagle3", "Qwen3Eagle3Model")]
)
def test_build_config_gives_the_kind_its_architecture(name, architecture):
    kind = get_kind(name)
    cfg = kind.build_config(
        tiny_qwen3_config(),
        preset(name, num_draft_layers=1),
        target_layer_ids=LAYER_IDS,
        mask_token_id=5,
        target_path="some/target",
    )
    assert cfg.architectures == [architecture] == [kind.architectures["qwen3"]]
    assert isinstance(build_draft_model(cfg), kind.model_class)


@pytest.mark.parametrize(
    ("option", "value"), [("loss_impl", "recompute"), ("attn_implementation", "blockwise")]
)
def test_eagle3_refuses_perf_options_it_cannot_honour(option, value):
    perf = PerfConfig(**{option: value})
    get_kind("dspark").check_perf(perf)  # DSpark has both
    with pytest.raises(ValueError, match=f"perf.{option}: '{value}' is not available for eagle3"):
        get_kind("eagle3").check_perf(perf)


def test_eagle3_honours_perf():
    kind, model = get_kind("eagle3"), tiny_eagle3()
    assert kind.prepare(model, PerfConfig()) == "chunked"
    assert kind.prepare(model, PerfConfig(loss_impl="reference")) == "reference"
    # flex, not what a CPU drafter picks by itself (dense), so a dropped option shows
    assert model.resolve_attn_implementation(torch.device("cpu")) == "dense"
    kind.prepare(model, PerfConfig(attn_implementation="flex"))
    assert model.resolve_attn_implementation(torch.device("cpu")) == "flex"
    assert eagle3_loss.loss_impl_for("auto", zero3=True) == "reference"
    with pytest.raises(ValueError, match="perf.loss_impl: chunked .* under ZeRO-3"):
        eagle3_loss.loss_impl_for("chunked", zero3=True)
    # the run's ZeRO stage is passed down, not read off the parameters
    assert kind.prepare(model, PerfConfig(), zero_stage=3) == "reference"
    with pytest.raises(ValueError, match="under ZeRO-3"):
        kind.prepare(model, PerfConfig(loss_impl="chunked"), zero_stage=3)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_each_kind_gives_its_step_shape_part_and_its_tags(name):
    # what the tuner and evaluation ask of a kind: its part of the StepShape from the run's
    # `model` section (read by its activation and FLOP terms), its eval tags from a drafter
    model = preset(name, num_draft_layers=1, num_anchors=8, block_size=4, ttt_length=3)
    kind = get_kind(model.kind)
    shape = StepShape(batch=1, seq_len=32, hidden=64, intermediate=160, vocab=1000, heads=4,
                      kv_heads=2, head_dim=16, draft_layers=1, taps=3,
                      drafter=kind.step_part(model))  # fmt: skip
    for stage in (0, 3):
        assert sum(kind.activation_bytes(shape, PerfConfig(), "cpu", stage).values()) > 0
        assert sum(kind.step_flops(shape, PerfConfig(), "cpu", stage).values()) > 0
    bigger = StepShape(**{**shape.__dict__, "drafter": kind.step_part(replace(
        model, num_anchors=16, block_size=8, ttt_length=6))})  # fmt: skip
    assert sum(kind.step_flops(bigger, PerfConfig(), "cpu", 0).values()) > sum(
        kind.step_flops(shape, PerfConfig(), "cpu", 0).values()
    )
    drafter = tiny_eagle3(3) if model.kind == "eagle3" else tiny_drafter()
    tags = kind.tags(drafter.config)
    assert tags and all(v is not None for v in tags.values())


def test_eagle3_chunk_size_comes_from_perf(monkeypatch):
    """perf.loss_chunk_anchors positions of T steps each: loss_chunk_anchors × T rows."""
    model = tiny_eagle3(ttt_length=3)
    batch = random_batch(model, batch=2, seq_len=12)
    seen = []
    original = eagle3_loss.chunked_eagle3_loss

    def spy(*args, chunk_rows, **kwargs):
        seen.append(chunk_rows)
        return original(*args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(eagle3_loss, "chunked_eagle3_loss", spy)
    losses = {}
    for impl in ("chunked", "reference"):
        ctx = StepContext(preset("eagle3"), PerfConfig(loss_chunk_anchors=2), loss_impl=impl)
        losses[impl] = get_kind("eagle3").training_step(model, batch, ctx).loss
    assert seen == [6]
    torch.testing.assert_close(losses["chunked"], losses["reference"], rtol=1e-5, atol=1e-6)


def test_dspark_step_samples_anchors_per_sample_and_uses_the_loss_weights():
    model = tiny_drafter()
    batch = random_batch(model, batch=2, seq_len=24)
    batch["sample_ids"] = torch.tensor([7, 3])
    m = preset("dflash")  # not the loss functions' defaults
    ctx = StepContext(model=m, perf=PerfConfig(), loss_impl="reference", seed=5, epoch=2)
    out = get_kind("dspark").training_step(model, batch, ctx)
    loss, metrics = out.loss, get_kind("dspark").metrics(out.global_sums(), m)
    anchors, keep = sample_anchors(batch["loss_mask"], batch["sample_ids"], 6, seed=5, epoch=2)
    inputs = {k: v for k, v in batch.items() if k != "sample_ids"}
    out = model(**inputs, anchor_positions=anchors, block_keep_mask=keep)
    ref, ref_metrics = compute_dspark_loss(out, **asdict(m.loss_weights))
    assert torch.equal(loss, ref)  # the trainer's on-device step is the reference, bit for bit
    assert metrics == ref_metrics and metrics["supervised_tokens"] > 0
