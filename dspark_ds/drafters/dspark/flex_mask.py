"""DSpark's block mask for the flex_attention path: a BlockMask built straight from the anchors
(its kernel: drafters/common/flex.py).

flex_attention skips every (128 query x 128 key) tile the mask hides and skips
the mask itself on tiles it shows whole. `create_block_mask` finds those tiles by evaluating
`mask_mod` on every (query, key) pair: [B, A*G, S + A*G] work and memory per call (B 1, S 4096,
A 512, γ 7: 27 M pairs, every step). The DSpark visibility (docs/algorithm.md#the-block-mask) has structure that gives the
tiles directly: query row r of block qb = r // G sees the context keys [0, anchor[qb]) and its
own block's keys [S + qb*G, S + qb*G + G), nothing if the block is dropped. So per query tile
the largest and smallest visible context length decide which context tiles it touches and which
it sees whole, and a prefix sum of the kept blocks decides which draft tiles it touches:
O(B x A*G) for the per-row lengths plus O(B x tiles) for the tile table, on the device, with no
host sync. `BlockMask.from_kv_blocks` takes the table in the same order `create_block_mask`
produces (tests/unit/test_perf_flex.py compares the two).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from dspark_ds.drafters.common.flex import TILE


def block_visibility(
    anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor, *, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §4 in two [B, A] long tensors: block qb sees the context keys [0, ctx_end[qb]) and
    the keys [own_start[qb], own_start[qb] + G); a dropped block sees nothing (ctx_end 0,
    own_start -2G, below any key)."""
    keep = block_keep_mask.bool()
    num_blocks = anchor_positions.shape[1]
    zero = torch.zeros((), dtype=torch.long, device=anchor_positions.device)
    ctx_end = torch.where(keep, anchor_positions.long().clamp(0, seq_len), zero)
    own = seq_len + block_size * torch.arange(num_blocks, device=anchor_positions.device)
    own_start = torch.where(keep, own, zero - 2 * block_size)
    return ctx_end, own_start


def dspark_mask_mod(ctx_end: torch.Tensor, own_start: torch.Tensor, block_size: int):
    """The visibility as a flex mask_mod over [context (S); drafts (A*G)] keys. It captures
    only [B, A] tensors and the block size: S lives in own_start (see the module docstring).
    Query rows past A*G (the last tile's padding) read the last block."""
    last = ctx_end.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        qb = (q_idx // block_size).clamp(max=last)
        rel = kv_idx - own_start[b, qb]
        return (kv_idx < ctx_end[b, qb]) | ((rel >= 0) & (rel < block_size))

    return mask_mod


def _ordered(tiles_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nQ, nKV] bool tile table -> (num [B, 1, nQ], indices [B, 1, nQ, nKV]) int32, the
    layout and order create_block_mask uses (listed tiles first, ascending; then the rest)."""
    dense = tiles_BQK.unsqueeze(1).to(torch.int32)
    num = dense.sum(dim=-1).to(torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def dspark_block_mask(
    anchor_positions: torch.Tensor,
    block_keep_mask: torch.Tensor,
    *,
    seq_len: int,
    block_size: int,
    tile: int = TILE,
) -> BlockMask:
    """The block-mask visibility (docs/algorithm.md#the-block-mask) as a BlockMask, built from the anchors in O(B x (A*G + tiles)).

    Queries: the A*G draft slots; keys: [context (S); drafts (A*G)]. Equal to
    `create_block_mask(mask_mod, B, None, A*G, S + A*G)` on the same visibility.
    """
    bsz, num_blocks = anchor_positions.shape
    G, S, dev = block_size, seq_len, anchor_positions.device
    q_len = num_blocks * G
    kv_len = S + q_len
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    ctx_end, own_start = block_visibility(
        anchor_positions, block_keep_mask, seq_len=S, block_size=G
    )
    keep = block_keep_mask.bool()

    # per query tile: the longest and shortest visible context among its rows (padding rows
    # past A*G see nothing)
    rows = torch.arange(n_q * tile, device=dev)
    row_ctx = ctx_end[:, (rows // G).clamp(max=num_blocks - 1)]
    row_ctx = torch.where(rows < q_len, row_ctx, torch.zeros_like(row_ctx)).view(bsz, n_q, tile)
    ctx_max = row_ctx.amax(dim=-1)[:, :, None]  # [B, nQ, 1]
    ctx_min = row_ctx.amin(dim=-1)[:, :, None]

    # key tiles [k0, k1): a context part [k0, min(k1, S)) and a draft part [max(k0, S), k1)
    k0 = torch.arange(n_kv, device=dev) * tile
    k1 = (k0 + tile).clamp(max=kv_len)
    has_ctx, has_draft = k0 < S, k1 > S
    ctx_any = has_ctx & (ctx_max > k0)
    ctx_all = ~has_ctx | (ctx_min >= k1.clamp(max=S))

    # the draft part holds the keys of blocks [d_lo, d_hi]; query tile i holds the rows of
    # blocks [b_lo, b_hi]: a row sees a draft key only of its own (kept) block
    d_lo = (k0.clamp(min=S) - S) // G
    d_hi = (k1 - 1 - S).clamp(min=0) // G
    q0 = torch.arange(n_q, device=dev) * tile
    q1 = (q0 + tile).clamp(max=q_len)
    b_lo, b_hi = q0 // G, (q1 - 1) // G
    lo = torch.maximum(b_lo[:, None], d_lo[None, :])  # [nQ, nKV]
    hi = torch.minimum(b_hi[:, None], d_hi[None, :])
    kept_before = torch.nn.functional.pad(keep.to(torch.int32).cumsum(dim=-1), (1, 0))
    kept_between = (
        kept_before[:, (hi + 1).clamp(0, num_blocks)] - kept_before[:, lo.clamp(max=num_blocks)]
    )
    draft_any = has_draft & (hi >= lo) & (kept_between > 0)
    # every row of the tile sees every draft key of it: one kept block on both sides
    one_block = (b_lo == b_hi)[:, None] & (d_lo == d_hi)[None, :] & (b_lo[:, None] == d_lo[None, :])
    draft_all = ~has_draft | (one_block & keep[:, b_lo.clamp(max=num_blocks - 1)][:, :, None])

    whole_tile = (q0 + tile <= q_len)[:, None] & (k0 + tile <= kv_len)[None, :]
    any_visible = ctx_any | draft_any
    full = whole_tile & ctx_all & draft_all & any_visible
    partial = any_visible & ~full
    num, idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(tile, tile),
        mask_mod=dspark_mask_mod(ctx_end, own_start, G),
        seq_lengths=(q_len, kv_len),
    )
