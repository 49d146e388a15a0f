"""The flex_attention path (drafters/dspark/flex_mask.py, drafters/common/flex.py): the BlockMask
built from the anchors equals create_block_mask's on the block mask's mask_mod (docs/algorithm.md#the-block-mask), and flex forward (eager; compiled in the slow test)
equals the dense and blockwise attention. flex_attention has no backward on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dspark_ds.drafters.common.flex import flex_attend
from dspark_ds.drafters.dspark.block_attention import BlockwiseMask, attend, dense_block_mask
from dspark_ds.drafters.dspark.blocks import sample_anchor_positions
from dspark_ds.drafters.dspark.flex_mask import dspark_block_mask


def spec_block_mask(anchors, keep, seq_len: int, block_size: int):
    """create_block_mask over every (query, key) pair of the block-mask visibility (docs/algorithm.md), as written."""

    def mask_mod(b, h, q_idx, kv_idx):
        qb = q_idx // block_size
        in_ctx = (kv_idx < seq_len) & (kv_idx < anchors[b, qb])
        in_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == qb)
        return (in_ctx | in_block) & keep[b, qb]

    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    return create_block_mask(
        mask_mod, B=bsz, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len, device=anchors.device
    )


def random_anchors(bsz: int, seq_len: int, num_anchors: int, seed: int, drop: bool = True):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(bsz, seq_len)
    loss_mask[:, : min(3, seq_len - 2)] = 0
    if bsz > 1:  # a short second sample: fewer candidates than anchors -> dummy blocks
        loss_mask[1, seq_len // 3 :] = 0
    anchors, keep = sample_anchor_positions(loss_mask, num_anchors, generator=g)
    if drop and num_anchors > 2:  # a dropped block amid kept ones
        keep[0, 1] = False
    return anchors, keep


def listed_tiles(num: torch.Tensor, idx: torch.Tensor) -> list[set[int]]:
    """Each query tile's listed key tiles, as a set (the order within a row is free)."""
    rows = num.flatten().tolist()
    return [set(r[:n]) for r, n in zip(idx.flatten(0, -2).tolist(), rows)]


# S below, at and across tile edges; A*G below, at and across tile edges; G = 1, γ-like, and
# blocks as large as a tile (full tiles); dropped and dummy blocks; B = 1 and 2
SHAPES = [
    *itertools.product([5, 127, 300, 1000], [1, 3, 20, 150], [1, 4, 7], [2]),
    *itertools.product([128, 300], [1, 3], [128, 131], [1, 2]),
]


@pytest.mark.parametrize("seq_len,num_anchors,block_size,bsz", SHAPES)
def test_direct_block_mask_equals_create_block_mask(seq_len, num_anchors, block_size, bsz):
    anchors, keep = random_anchors(bsz, seq_len, num_anchors, seed=seq_len + block_size)
    got = dspark_block_mask(anchors, keep, seq_len=seq_len, block_size=block_size)
    want = spec_block_mask(anchors, keep, seq_len, block_size)
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    assert torch.equal(got.to_dense(), want.to_dense())
    for name in ("kv", "full_kv", "q", "full_q"):
        g_num, w_num = getattr(got, f"{name}_num_blocks"), getattr(want, f"{name}_num_blocks")
        g_idx, w_idx = getattr(got, f"{name}_indices"), getattr(want, f"{name}_indices")
        assert torch.equal(g_num, w_num), name
        assert listed_tiles(g_num, g_idx) == listed_tiles(w_num, w_idx), name


def test_full_tiles_are_found():
    """A block of 128 slots anchored late sees whole context tiles: they are listed full (no
    mask_mod evaluated there), exactly where create_block_mask finds them."""
    anchors = torch.tensor([[1000, 640, 0]])
    keep = torch.tensor([[True, True, False]])
    got = dspark_block_mask(anchors, keep, seq_len=1024, block_size=128)
    want = spec_block_mask(anchors, keep, 1024, 128)
    # query tile = block: 896 / 128 context tiles + its own, 640 / 128 + its own, dropped
    assert got.full_kv_num_blocks.tolist() == want.full_kv_num_blocks.tolist() == [[[8, 6, 0]]]
    # the context tile [896, 1024) that anchor 1000 cuts
    assert got.kv_num_blocks.tolist() == want.kv_num_blocks.tolist() == [[[1, 0, 0]]]


def _qkv(bsz, q_heads, kv_heads, seq_len, num_anchors, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q_len, D = num_anchors * block_size, 16
    q = torch.randn(bsz, q_heads, q_len, D, generator=g, dtype=dtype)
    k = torch.randn(bsz, kv_heads, seq_len + q_len, D, generator=g, dtype=dtype)
    v = torch.randn(bsz, kv_heads, seq_len + q_len, D, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "seq_len,num_anchors,block_size,q_heads,kv_heads",
    [(40, 6, 4, 4, 2), (200, 24, 7, 4, 1), (129, 40, 5, 2, 2), (300, 3, 16, 8, 2)],
)
def test_flex_forward_equals_dense_and_blockwise(
    seq_len, num_anchors, block_size, q_heads, kv_heads
):
    anchors, keep = random_anchors(2, seq_len, num_anchors, seed=num_anchors)
    q, k, v = _qkv(2, q_heads, kv_heads, seq_len, num_anchors, block_size, torch.float64, 0)
    dense = attend(
        q,
        k,
        v,
        dense_block_mask(anchors, keep, seq_len=seq_len, block_size=block_size),
        scaling=0.3,
    )
    blockwise = attend(
        q, k, v, BlockwiseMask(anchors, keep, seq_len=seq_len, block_size=block_size), scaling=0.3
    )
    mask = dspark_block_mask(anchors, keep, seq_len=seq_len, block_size=block_size)
    flex = flex_attend(q, k, v, mask, scaling=0.3, compiled=False)
    torch.testing.assert_close(flex, dense, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(blockwise, dense, rtol=1e-10, atol=1e-10)
    rows = (~keep).repeat_interleave(block_size, dim=1)  # dropped / dummy blocks
    assert rows.any() and flex.transpose(1, 2)[rows].abs().max() == 0


@pytest.mark.slow
def test_compiled_flex_forward_equals_dense_and_compiles_twice():
    """torch.compile(flex_attention) on CPU (forward only): equal to dense attention for every
    sequence length, and the varying key length costs one recompile, not one per length."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with torch.no_grad():
        for seq_len in (200, 260, 333, 410, 129):
            anchors, keep = random_anchors(1, seq_len, 24, seed=seq_len)
            q, k, v = _qkv(1, 4, 2, seq_len, 24, 5, torch.float32, seq_len)
            mask = dspark_block_mask(anchors, keep, seq_len=seq_len, block_size=5)
            flex = flex_attend(q, k, v, mask, scaling=0.25, compiled=True)
            dense = attend(
                q,
                k,
                v,
                dense_block_mask(anchors, keep, seq_len=seq_len, block_size=5),
                scaling=0.25,
            )
            torch.testing.assert_close(flex, dense, rtol=2e-5, atol=2e-5)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2, 2, 2], graphs
