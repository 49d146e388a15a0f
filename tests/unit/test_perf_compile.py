"""`perf.compile`: a drafter compiled with inductor (on CPU here) gives the eager loss and
gradients, through the training step's default loss path (the compiled layers also under
`perf.activation_checkpointing`: recomputed in backward, as torchtitan runs its blocks)."""

from __future__ import annotations

import copy

import pytest
import torch

from dspark_ds.drafters.dspark.step import forward_and_loss
from dspark_ds.drafters.perf import PerfConfig, compile_drafter
from dspark_ds.drafters.registry import get_kind

from helpers.drafters import random_batch, tiny_drafter

LOSS_ARGS = dict(
    loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
)


def loss_and_grads(model, batch, impl: str):
    model.zero_grad(set_to_none=True)
    loss, metrics = forward_and_loss(
        model,
        batch,
        LOSS_ARGS,
        impl=impl,
        chunk_anchors=4,
        generator=torch.Generator().manual_seed(0),
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,impl,recompute", [("layers", "chunked", True), ("model", "reference", False)]
)
def test_compiled_drafter_equals_eager(mode, impl, recompute):
    import torch._dynamo

    torch._dynamo.reset()
    eager = tiny_drafter(markov_head_type="gated", num_draft_layers=1)
    compiled = compile_drafter(copy.deepcopy(eager), mode)
    compiled.activation_checkpointing = recompute
    names = [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints unchanged
    batch = random_batch(eager, batch=2, seq_len=24, seed=1)
    want_loss, want_metrics, want = loss_and_grads(eager, batch, impl)
    got_loss, got_metrics, got = loss_and_grads(compiled, batch, impl)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_metrics["tau_probabilistic"] == pytest.approx(want_metrics["tau_probabilistic"])
    assert got.keys() == want.keys() and len(want) > 5
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_perf_defaults_per_device():
    cfg = PerfConfig()
    assert cfg.chunk_anchors("cpu") == 32 and cfg.chunk_anchors(torch.device("cuda", 0)) == 256
    assert PerfConfig(loss_chunk_anchors=64).chunk_anchors("cuda") == 64
    assert cfg.compile_mode("cpu") == "off" and cfg.compile_mode("cuda") == "off"
    model = tiny_drafter()
    get_kind("dspark").train.prepare(model, PerfConfig(attn_implementation="dense"), "cpu")
    assert model.attn_implementation == "dense"
    assert not hasattr(model.layers[0], "_compiled_call_impl") or (
        model.layers[0]._compiled_call_impl is None
    )
    for bad, field in (
        (dict(loss_chunk_anchors="big"), "perf.loss_chunk_anchors"),
        (dict(loss_chunk_anchors=0), "perf.loss_chunk_anchors"),
        (dict(compile="everything"), "perf.compile"),
        (dict(compile_backend="inductr"), "perf.compile_backend: 'inductr' is not a torch.compile"),
    ):
        with pytest.raises(ValueError, match=field):
            PerfConfig(**bad)
