"""Blockwise attention computes exactly what the dense block mask computes."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.drafters.dspark.block_attention import BlockwiseMask, attend, dense_block_mask

from helpers.drafters import random_batch, tiny_drafter


@pytest.mark.parametrize("chunk_blocks", [1, 2, 32])
@pytest.mark.parametrize("groups", [1, 2])
def test_blockwise_kernel_equals_dense(chunk_blocks, groups):
    torch.manual_seed(0)
    B, Hkv, D, S, A, G = 2, 2, 8, 30, 5, 4
    q = torch.randn(B, Hkv * groups, A * G, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S + A * G, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, S + A * G, D, dtype=torch.float64, requires_grad=True)
    # Unsorted anchors, an anchor at 0 (no context) and two dummy blocks.
    anchors = torch.tensor([[20, 3, 0, 28, 10], [5, 1, 9, 0, 0]])
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    weight = torch.randn(B, Hkv * groups, A * G, D, dtype=torch.float64)
    results = []
    for mask in (
        dense_block_mask(anchors, keep, seq_len=S, block_size=G),
        BlockwiseMask(anchors, keep, seq_len=S, block_size=G, chunk_blocks=chunk_blocks),
    ):
        out = attend(q, k, v, mask, scaling=0.3)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        results.append((out, *grads))
    for dense, blockwise in zip(*results):
        torch.testing.assert_close(blockwise, dense, rtol=1e-12, atol=1e-12)
    out = results[1][0].view(B, Hkv * groups, A, G, D)
    assert out[1, :, 3:].abs().max() == 0  # dummy blocks give exact zeros
    assert out[0, :, 2].abs().min() > 0  # anchor 0 still sees its own block


def test_blockwise_model_forward_and_grads_equal_dense():
    model = tiny_drafter(markov_head_type="rnn")
    batch = random_batch(model, batch=2, seq_len=24, seed=1)
    results = {}
    for impl in ("dense", "blockwise"):
        model.attn_implementation = impl
        model.zero_grad(set_to_none=True)
        out = model(**batch, generator=torch.Generator().manual_seed(0))
        (out.draft_logits.square().mean() + out.confidence_pred.mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (out, grads)
    (dense, dense_grads), (block, block_grads) = results["dense"], results["blockwise"]
    assert torch.equal(dense.anchor_positions, block.anchor_positions)
    torch.testing.assert_close(block.draft_logits, dense.draft_logits, rtol=1e-5, atol=1e-5)
    for name, g in dense_grads.items():
        torch.testing.assert_close(block_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_is_blockwise_on_cpu():
    model = tiny_drafter()
    assert model.resolve_attn_implementation(torch.device("cpu")) == "blockwise"
    assert model.resolve_attn_implementation(torch.device("cuda")) == "flex"
