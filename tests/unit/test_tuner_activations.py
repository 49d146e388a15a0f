"""The tuner's activation model (dspark_ds/drafters/dspark/memory.py) against measurements that do not
depend on an allocator (helpers/memory.py): the bytes autograd saves for backward, and the peak
of live tensors over one micro-batch (forward, loss, backward), at several small shapes, both
dtypes, every attention implementation CPU can train with and every loss path; with the draft
layers recomputed in backward (perf.activation_checkpointing), for DSpark and Eagle3."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config

from dspark_ds.drafters import build_draft_config, build_draft_model
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.memory import DSparkShape, saved_bytes
from dspark_ds.drafters.dspark.memory import micro_batch_bytes as activation_bytes
from dspark_ds.drafters.dspark.step import forward_and_loss

from helpers.memory import micro_batch_memory

LOSS_ARGS = dict(
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
)
# (the vocabulary-sized loss dominates; the layers and the loss weigh alike; the layers dominate)
SHAPES = {
    "vocab": StepShape.of(
        Widths(64, 160, 16000, 4, 2, 16, 2, 3), 1, 256, DSparkShape(32, 4, 16), 4, 4
    ),
    "mixed": StepShape.of(
        Widths(128, 320, 6000, 8, 2, 16, 2, 3), 1, 384, DSparkShape(48, 6, 32), 4, 4
    ),
    "layers": StepShape.of(
        Widths(128, 640, 2000, 8, 2, 16, 2, 3), 1, 384, DSparkShape(48, 6, 16), 4, 4
    ),
}
CHUNK_ANCHORS = 5


def measure(
    shape: StepShape, attn: str, loss: str, dtype: torch.dtype, recompute: bool = False
) -> dict[str, int]:
    s = shape
    target = Qwen3Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.taps + 1,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        tie_word_embeddings=False,
    )
    draft = build_draft_config(
        target,
        target_layer_ids=list(range(s.taps)),
        mask_token_id=s.vocab - 1,
        num_draft_layers=s.draft_layers,
        block_size=s.drafter.block_size,
        num_anchors=s.drafter.num_anchors,
        markov_rank=s.drafter.markov_rank,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
    )
    torch.manual_seed(0)
    model = build_draft_model(draft)
    model.freeze_shared()
    model.to(dtype).train()
    model.attn_implementation = attn
    model.activation_checkpointing = recompute
    g = torch.Generator().manual_seed(1)
    B, S, H = s.batch, s.seq_len, s.hidden
    loss_mask = torch.ones(B, S)
    loss_mask[:, :8] = 0
    anchors, keep = sample_anchor_positions(loss_mask, s.drafter.num_anchors, generator=g)
    batch = dict(
        input_ids=torch.randint(0, s.vocab - 1, (B, S), generator=g),
        loss_mask=loss_mask,
        target_hidden_states=torch.randn(B, S, s.taps * H, generator=g).to(dtype),
        target_last_hidden_states=torch.randn(B, S, H, generator=g).to(dtype),
        anchor_positions=anchors,
        block_keep_mask=keep,
    )

    def step() -> torch.Tensor:
        return forward_and_loss(model, batch, LOSS_ARGS, impl=loss, chunk_anchors=CHUNK_ANCHORS)[0]

    return micro_batch_memory(model, batch, step)


# the "mixed" shape takes most of the time: it runs with the slow tests
CASES = [
    pytest.param(*case, marks=[pytest.mark.slow] if case[0] == "mixed" else [])
    for case in itertools.product(
        ("vocab", "mixed"), ("blockwise", "dense"), ("reference", "chunked", "recompute")
    )
]


@pytest.mark.parametrize("shape_name,attn,loss", CASES)
def test_estimate_matches_saved_tensors_and_live_peak(shape_name, attn, loss):
    for dtype in (torch.float32, torch.bfloat16):
        b = 4 if dtype == torch.float32 else 2
        shape = replace(SHAPES[shape_name], compute_bytes=b, feature_bytes=b)
        got = measure(shape, attn, loss, dtype)
        est = activation_bytes(shape, attn, loss, CHUNK_ANCHORS)
        # the batch is allocated before the measured micro-batch
        peak = sum(est.values()) - est["features_in"]
        assert peak == pytest.approx(got["peak_bytes"], rel=0.05), (dtype, est, got)
        if loss == "chunked":  # the drafter's saves; the chunked loss itself saves ~nothing
            saved = sum(saved_bytes(shape, attn).values())
            assert saved == pytest.approx(got["saved_bytes"], rel=0.02), (dtype, got)


# Recomputed layers: where the loss is the peak (the layers keep their inputs beside it) and where
# the last layer's backward is (its saves exist again, with its MLP's or attention's backward)
RECOMPUTE_CASES = [
    ("vocab", "blockwise", "chunked", 4),
    ("vocab", "dense", "recompute", 2),
    ("layers", "blockwise", "chunked", 4),
    ("layers", "blockwise", "chunked", 2),
    ("layers", "dense", "recompute", 4),
    ("layers", "dense", "recompute", 2),
]


@pytest.mark.parametrize("shape_name,attn,loss,b", RECOMPUTE_CASES)
def test_recomputed_layers_estimate_matches_live_peak(shape_name, attn, loss, b):
    dtype = torch.float32 if b == 4 else torch.bfloat16
    shape = replace(SHAPES[shape_name], compute_bytes=b, feature_bytes=b)
    got = measure(shape, attn, loss, dtype, recompute=True)["peak_bytes"]
    est = activation_bytes(shape, attn, loss, CHUNK_ANCHORS, recompute=True)
    peak = sum(est.values()) - est["features_in"]
    # NOTE: where the blockwise attention backward is the peak the model is under by a term it
    # does not identify (docs/tuner.md): 8 % here under bf16, as for the layers kept (below)
    rel = 0.1 if (shape_name, attn, b) == ("layers", "blockwise", 2) else 0.05
    assert peak == pytest.approx(got, rel=rel), (est, got)
    assert ("recomputed_layer" in est) == (shape_name == "layers")
    if shape_name == "layers" and b == 4:  # recomputation is what makes the difference
        plain = measure(shape, attn, loss, dtype)["peak_bytes"]
        assert got < 0.7 * plain
        est_plain = activation_bytes(shape, attn, loss, CHUNK_ANCHORS)
        saved = (sum(est_plain.values()) - sum(est.values())) / (plain - got)
        assert saved == pytest.approx(1.0, rel=0.05)


def test_eagle3_recomputed_layers_save_what_the_model_says():
    """Eagle3 (2 layers, 3 unrolled steps, dense attention, chunked loss, fp32): the peak
    recomputation saves — every step's layers keeping their input and keys / values instead of
    their saves — measured and modelled alike (within 10 %: the model without recomputation is
    itself 12 % under this tiny shape's measured peak)."""
    from dspark_ds.drafters.eagle3.memory import Eagle3Shape
    from dspark_ds.drafters.kind import StepContext
    from dspark_ds.drafters.perf import PerfConfig
    from dspark_ds.drafters.presets import preset
    from dspark_ds.drafters.registry import get_kind

    from helpers.drafters import MASK_ID, random_batch, tiny_qwen3_config

    section = preset("eagle3", num_draft_layers=2, ttt_length=3)
    kind = get_kind(section.kind)
    config = kind.build_config(
        tiny_qwen3_config(), section, target_layer_ids=[0, 1, 2], mask_token_id=MASK_ID
    )
    torch.manual_seed(0)
    model = build_draft_model(config)
    model.freeze_shared()
    model.train()
    batch = random_batch(model, batch=2, seq_len=20, seed=1)
    batch["sample_ids"] = torch.arange(2)
    c = config
    widths = (c.hidden_size, c.intermediate_size, c.vocab_size)
    heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    shape = StepShape.of(
        Widths(*widths, *heads, c.num_hidden_layers, 3), 2, 20, Eagle3Shape(3), 4, 4
    )
    peaks, models = [], []
    for recompute in (False, True):
        perf = PerfConfig(
            attn_implementation="dense",
            loss_impl="chunked",
            loss_chunk_anchors=4,
            activation_checkpointing=recompute,
        )
        impl = kind.train.prepare(model, perf, "cpu")
        context = StepContext(section, perf, impl, seed=3)

        def step(context=context):
            return kind.train.training_step(model, batch, context).loss

        peaks.append(micro_batch_memory(model, batch, step)["peak_bytes"])
        models.append(sum(kind.cost.activation_bytes(shape, perf, "cpu", 0).values()))
    assert peaks[1] < 0.5 * peaks[0]
    assert models[0] - models[1] == pytest.approx(peaks[0] - peaks[1], rel=0.1)


def test_qwen3_8b_shape_per_path():
    """The Qwen3-8B DSpark shape of issue 13 (B 1, S 4096, A 512, γ 7, bf16): the compiled-flex
    chunked path (chunk 256) needs well under the dense / reference path's working memory."""
    shape = StepShape.of(
        Widths(4096, 12288, 151936, 32, 8, 128, 5, 5), 1, 4096, DSparkShape(512, 7, 256)
    )
    flex = sum(activation_bytes(shape, "flex", "chunked", 256).values())
    dense = sum(activation_bytes(shape, "dense", "reference", 256).values())
    assert 9 * 2**30 < flex < 10.5 * 2**30 and 14 * 2**30 < dense < 16 * 2**30
    assert flex / dense < 0.7


# Long sequences at fixed anchors: one draft layer 64 wide, A 48 (three blockwise chunks), γ 4
LONG = StepShape.of(Widths(64, 160, 2000, 4, 2, 16, 1, 3), 1, 512, DSparkShape(48, 4, 16), 4, 4)
LENGTHS = (512, 1024, 2048)


def per_token_steps(values: list[float], lengths=LENGTHS) -> list[float]:
    """Bytes per added token between consecutive sequence lengths."""
    return [(b - a) / (s1 - s0) for a, b, s0, s1 in zip(values, values[1:], lengths, lengths[1:])]


@pytest.mark.parametrize("attn", ["blockwise", "dense"])
def test_memory_grows_linearly_with_the_sequence_at_fixed_anchors(attn):
    """The block attention is anchors × γ queries against the context: at a fixed anchor count
    nothing grows with the sequence squared — the saved bytes (measured and modelled) add the
    same bytes per token at every doubling, and the modelled peak stays within 10 % of the
    measured one (the blockwise attention backward, the peak from 1 024 tokens on, is 5-9 %
    under: docs/tuner.md)."""
    got = [measure(replace(LONG, seq_len=S), attn, "chunked", torch.float32) for S in LENGTHS]
    model_saved = [sum(saved_bytes(replace(LONG, seq_len=S), attn).values()) for S in LENGTHS]
    for series in ([g["saved_bytes"] for g in got], model_saved):
        first, second = per_token_steps(series)
        assert second == pytest.approx(first, rel=0.02), series
    for S, g, saved in zip(LENGTHS, got, model_saved):
        est = activation_bytes(replace(LONG, seq_len=S), attn, "chunked", CHUNK_ANCHORS)
        assert saved == pytest.approx(g["saved_bytes"], rel=0.02), (S, g)
        assert sum(est.values()) - est["features_in"] == pytest.approx(g["peak_bytes"], rel=0.1)


def test_dense_attention_with_anchors_growing_with_the_sequence_is_quadratic_in_both():
    """With A ∝ S (a block at every 16th position) the dense path's mask, as an additive
    [A·γ, S + A·γ] bias, grows with S²: measured and modelled alike."""
    lengths = (256, 512, 1024)
    shapes = [replace(LONG, seq_len=S, drafter=DSparkShape(S // 16, 4, 16)) for S in lengths]
    got = [measure(s, "dense", "chunked", torch.float32)["saved_bytes"] for s in shapes]
    model = [sum(saved_bytes(s, "dense").values()) for s in shapes]
    for m, g in zip(model, got):
        assert m == pytest.approx(g, rel=0.02)
    # a quadratic term: more bytes per token at each doubling, by as much as the model says
    (g1, g2), (m1, m2) = per_token_steps(got, lengths), per_token_steps(model, lengths)
    assert g2 - g1 > 0.1 * g1 and g2 - g1 == pytest.approx(m2 - m1, rel=0.05)
