"""The flex_attention path of the block attention: a BlockMask built straight from the anchors,
and one compiled flex_attention per process.

The BlockMask. flex_attention skips every (128 query x 128 key) tile the mask hides and skips
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

The kernel. Called without torch.compile, flex_attention runs an unfused fallback that
materialises the whole score matrix (3.5x slower than dense SDPA on an H200, docs/performance.md).
`flex_attend` uses one `torch.compile(flex_attention)` per process on CUDA. Varying shapes:
the trainer pads each batch to its longest sample, so the key length S + A*G changes from
batch to batch while A*G stays fixed. The mask_mod reads S only through tensors it captures
(never a Python int, which dynamo would specialise on, recompiling for every length), and the
key length and key-tile counts are marked dynamic. The first call compiles for its shapes;
the first call with another key length recompiles once with them symbolic, and no call after
that recompiles: 2 graphs per grad mode (training; validation under no_grad), within dynamo's
recompile limit (8). tests/unit/test_perf_flex.py counts them on CPU. Bucketing S to a multiple of
the tile instead would still leave up to max_length / 128 static shapes, more than that limit.
On CPU the eager fallback stays the default: flex_attention has no CPU backward (training
there uses the blockwise kernel), and compiling its forward costs ~20 s of C++ builds.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

TILE = 128
"""flex_attention's sparse block size (query and key tiles)."""

_COMPILED = None


def compiled_flex_attention():
    """`torch.compile(flex_attention)`, made once per process (see the module docstring)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=None, fullgraph=True)
    return _COMPILED


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    scaling: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """flex_attention with GQA; compiled: None = on CUDA tensors (see the module docstring)."""
    if compiled is None:
        compiled = q.is_cuda
    if not compiled or torch.compiler.is_compiling():
        # NOTE: inside a compiled region (perf.compile layers / model) dynamo compiles this
        # call into the enclosing graph; a nested compiled function would only break it
        return flex_attention(
            q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )
    _mark_key_length_dynamic(k, v, block_mask)
    return compiled_flex_attention()(
        q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )


def _mark_key_length_dynamic(k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> None:
    """The key length (S + A*G) and the key-tile count vary from batch to batch: symbolic from
    the first compile on, instead of one static compile and a recompile per dimension."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(k, 2)
    mark(v, 2)
    for t, dim in (
        (block_mask.kv_indices, 3),
        (block_mask.full_kv_indices, 3),
        (block_mask.q_num_blocks, 2),
        (block_mask.q_indices, 2),
        (block_mask.full_q_num_blocks, 2),
        (block_mask.full_q_indices, 2),
    ):
        if t is not None:
            mark(t, dim)


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
