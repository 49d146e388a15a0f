"""`perf.activation_checkpointing`: recomputing every draft layer in backward gives the same
loss, metrics and gradients as keeping its activations, for every kind and backend, through the
kind's own training step; and autograd keeps less for backward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.kind import StepContext
from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.presets import preset
from dspark_ds.drafters.registry import get_kind

from helpers.drafters import MASK_ID, random_batch, tiny_qwen3_config
from helpers.gemma4 import tiny_gemma4_target_config
from helpers.memory import saved_bytes

SIZES = {
    "dspark": dict(num_draft_layers=2, block_size=4, num_anchors=6, markov_rank=8),
    "dflash": dict(num_draft_layers=2, block_size=4, num_anchors=6),
    "eagle3": dict(num_draft_layers=2, ttt_length=3),
}
TARGETS = {"qwen3": tiny_qwen3_config, "gemma4": tiny_gemma4_target_config}
# (preset, target family, attention, loss path): every kind and backend, each attention kernel
# CPU trains with, the loss paths whose backward differs
CASES = [
    ("dspark", "qwen3", "blockwise", "chunked"),
    ("dspark", "qwen3", "dense", "recompute"),
    ("dspark", "gemma4", "blockwise", "reference"),
    ("dflash", "qwen3", "blockwise", "chunked"),
    ("eagle3", "qwen3", "dense", "chunked"),
    ("eagle3", "gemma4", "dense", "reference"),
]


def build(name: str, family: str):
    section = preset(name, **SIZES[name])
    kind = get_kind(section.kind)
    config = kind.build_config(
        TARGETS[family](), section, target_layer_ids=[0, 1, 2], mask_token_id=MASK_ID
    )
    torch.manual_seed(0)
    model = build_draft_model(config)
    with torch.no_grad():  # larger weights than the init, so that every term matters
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.freeze_shared()
    batch = random_batch(model, batch=2, seq_len=20, seed=1)
    batch["sample_ids"] = torch.arange(2)
    return kind, section, model.train(), batch


def step(kind, section, model, batch, perf: PerfConfig):
    impl = kind.train.prepare(model, perf, "cpu")
    return kind.train.training_step(model, batch, StepContext(section, perf, impl, seed=3))


def loss_and_grads(kind, section, model, batch, perf: PerfConfig):
    model.zero_grad(set_to_none=True)
    out = step(kind, section, model, batch, perf)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.sums, grads


@pytest.mark.parametrize("name,family,attn,loss", CASES)
def test_recomputed_layers_give_the_same_loss_and_gradients(name, family, attn, loss):
    kind, section, model, batch = build(name, family)
    perf = PerfConfig(attn_implementation=attn, loss_impl=loss)
    want_loss, want_sums, want = loss_and_grads(kind, section, model, batch, perf)
    on = replace(perf, activation_checkpointing=True)
    got_loss, got_sums, got = loss_and_grads(kind, section, model, batch, on)
    assert model.activation_checkpointing
    # the same ops on the same inputs run again: exact on CPU in fp32
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    torch.testing.assert_close(got_sums, want_sums, rtol=0, atol=0)
    assert got.keys() == want.keys() and any(
        ".layers." in n or n.startswith("layers.") for n in want
    )
    for n, g in want.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(got[n], g, rtol=0, atol=0, msg=n)

    # what autograd keeps for backward: the layers' inputs instead of their saves
    def forward(p):
        return lambda: step(kind, section, model, batch, p).loss

    exclude = [*model.parameters(), *model.buffers(), *batch.values()]
    _, kept = saved_bytes(forward(perf), exclude)
    _, kept_on = saved_bytes(forward(on), exclude)
    assert kept_on < 0.8 * kept, (kept_on, kept)


def test_no_recomputation_outside_autograd():
    """Validation and decoding (no_grad) run the layers plainly: nothing to recompute."""
    kind, section, model, batch = build("dspark", "qwen3")
    perf = PerfConfig(activation_checkpointing=True)
    with torch.no_grad():
        got = step(kind, section, model, batch, perf).loss
    want = step(kind, section, model, batch, PerfConfig()).loss
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
