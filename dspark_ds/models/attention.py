"""Block attention visibility (spec §4) and the attention kernels that apply it.

Query = draft slot of block qb; key index kv runs over [context (S); drafts (A*G)]:
    visible = (kv < S and kv < anchor[qb]) or (kv >= S and (kv - S) // G == qb)
    visible = visible and block_keep_mask[qb]

Implementations, chosen by `attn_implementation`:
- "dense": a [B, 1, A*G, S+A*G] boolean mask and SDPA. Works everywhere with autograd; kept
  as the plain reference (it computes every masked score too).
- "blockwise": exact, computes only what the mask can show: each chunk of blocks attends to
  the context prefix up to its largest anchor plus its own G x G block, in one softmax. The
  CPU training path (flex_attention has no backward on CPU).
- "flex": a flex_attention BlockMask (GPU training; forward-only on CPU).
- None mask: every key visible (inference rounds, where the cache holds only context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATIONS = ("dense", "blockwise", "flex")
# Blocks per chunk of the blockwise path: small enough that the context cut follows the
# anchors closely (sorted anchors), large enough that per-chunk overhead stays negligible.
BLOCKWISE_CHUNK_BLOCKS = 32


@dataclass
class BlockwiseMask:
    """The spec §4 visibility in its factored form (no [Q, K] tensor is ever built)."""

    anchor_positions: torch.Tensor  # [B, A] long
    block_keep_mask: torch.Tensor  # [B, A] bool
    seq_len: int
    block_size: int
    chunk_blocks: int = BLOCKWISE_CHUNK_BLOCKS


def dense_block_mask(
    anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor, *, seq_len: int, block_size: int
) -> torch.Tensor:
    """[B, 1, A*G, S+A*G] bool visibility."""
    bsz, num_blocks = anchor_positions.shape
    device = anchor_positions.device
    q_block = torch.arange(num_blocks * block_size, device=device) // block_size  # [Q]
    anchor_q = anchor_positions[:, q_block]  # [B, Q]
    ctx = torch.arange(seq_len, device=device).view(1, 1, -1) < anchor_q.unsqueeze(-1)  # [B,Q,S]
    own = q_block.view(-1, 1) == q_block.view(1, -1)  # [Q, Q]
    mask = torch.cat([ctx, own.unsqueeze(0).expand(bsz, -1, -1)], dim=-1)
    mask = mask & block_keep_mask[:, q_block].unsqueeze(-1)
    return mask.unsqueeze(1)


def flex_block_mask(
    anchor_positions: torch.Tensor, block_keep_mask: torch.Tensor, *, seq_len: int, block_size: int
):
    """The same visibility as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        qb = q_idx // block_size
        in_ctx = (kv_idx < seq_len) & (kv_idx < anchor_positions[b, qb])
        in_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == qb)
        return (in_ctx | in_block) & block_keep_mask[b, qb]

    bsz, num_blocks = anchor_positions.shape
    q_len = num_blocks * block_size
    return create_block_mask(
        mask_mod,
        B=bsz,
        H=None,
        Q_LEN=q_len,
        KV_LEN=seq_len + q_len,
        device=anchor_positions.device,
    )


def build_block_mask(
    implementation: str,
    anchor_positions: torch.Tensor,
    block_keep_mask: torch.Tensor,
    *,
    seq_len: int,
    block_size: int,
):
    if implementation == "dense":
        return dense_block_mask(
            anchor_positions, block_keep_mask, seq_len=seq_len, block_size=block_size
        )
    if implementation == "blockwise":
        return BlockwiseMask(
            anchor_positions.long(), block_keep_mask.bool(), seq_len=seq_len, block_size=block_size
        )
    if implementation == "flex":
        return flex_block_mask(
            anchor_positions, block_keep_mask, seq_len=seq_len, block_size=block_size
        )
    raise ValueError(
        f"attn_implementation: expected one of {ATTN_IMPLEMENTATIONS}, got {implementation!r}"
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *, scaling: float
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D] (GQA), mask None | bool tensor | BlockMask.

    Returns [B, Hq, Q, D]; rows that see nothing are exactly zero.
    """
    if isinstance(mask, BlockwiseMask):
        return blockwise_attend(q, k, v, mask, scaling=scaling)
    if mask is None or isinstance(mask, torch.Tensor):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scaling)
        # NOTE: SDPA turns a fully masked row into NaN, and NaN * 0 weight is still NaN in
        # the loss. Open such rows to every key, then zero their output.
        row_sees_any = mask.any(dim=-1, keepdim=True)
        safe_mask = mask | ~row_sees_any
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, scale=scaling)
        return out * row_sees_any.to(out.dtype)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(
        q, k, v, block_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )


def blockwise_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockwiseMask, *, scaling: float
) -> torch.Tensor:
    """Exact block-mask attention without the masked work of the dense path.

    For a chunk of blocks, the visible keys are the context prefix [0, max anchor) and each
    block's own G draft keys: one [.., c*G, L + G] score tensor (context scores next to the
    block's own G x G scores) and one softmax, instead of [.., A*G, S + A*G].
    q [B, Hq, A*G, D], k/v [B, Hkv, S + A*G, D] -> [B, Hq, A*G, D].
    """
    bsz, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads = k.shape[1]
    groups = n_q_heads // n_kv_heads
    G, S = mask.block_size, mask.seq_len
    num_blocks = q_len // G
    if k.shape[2] != S + q_len:
        raise ValueError(f"blockwise attention: {k.shape[2]} keys, expected S + A*G = {S + q_len}")
    # GQA without repeat_interleave: q head h uses kv head h // groups.
    q6 = q.reshape(bsz, n_kv_heads, groups, num_blocks, G, head_dim)
    k_ctx, v_ctx = k[:, :, :S], v[:, :, :S]
    k_own = k[:, :, S:].reshape(bsz, n_kv_heads, 1, num_blocks, G, head_dim)
    v_own = v[:, :, S:].reshape(bsz, n_kv_heads, 1, num_blocks, G, head_dim)
    anchors, keep = mask.anchor_positions, mask.block_keep_mask
    # NOTE: a dummy block (keep False) would see nothing: open its row to every key it is
    # offered (finite softmax), then zero its output, as the dense path does.
    max_ctx = torch.where(keep, anchors, torch.zeros_like(anchors)).clamp(max=S)
    # One host sync for every chunk's context length (the largest anchor it holds).
    chunk_max = torch.stack([c.max() for c in max_ctx.split(mask.chunk_blocks, dim=1)]).tolist()
    outs = []
    for i, a0 in enumerate(range(0, num_blocks, mask.chunk_blocks)):
        a1 = min(a0 + mask.chunk_blocks, num_blocks)
        c, ctx_len = a1 - a0, chunk_max[i]
        q_c = q6[:, :, :, a0:a1]  # [B, Hkv, g, c, G, D]
        own = q_c @ k_own[:, :, :, a0:a1].transpose(-1, -2)  # [B, Hkv, g, c, G, G]
        keep_c = keep[:, a0:a1].view(bsz, 1, 1, c, 1, 1)
        if ctx_len > 0:
            q_rows = q_c.reshape(bsz, n_kv_heads, groups * c * G, head_dim)
            ctx = q_rows @ k_ctx[:, :, :ctx_len].transpose(-1, -2)
            ctx = ctx.view(bsz, n_kv_heads, groups, c, G, ctx_len)
            cols = torch.arange(ctx_len, device=q.device)
            visible = (cols < anchors[:, a0:a1].view(bsz, 1, 1, c, 1, 1)) | ~keep_c
            ctx = ctx.masked_fill(~visible, float("-inf"))
            scores = torch.cat([ctx, own], dim=-1) * scaling
        else:
            scores = own * scaling
        # Half-precision scores are normalised in fp32 (as SDPA does internally).
        acc = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
        probs = torch.softmax(scores, dim=-1, dtype=acc).to(q.dtype)
        out = probs[..., ctx_len:] @ v_own[:, :, :, a0:a1]
        if ctx_len > 0:
            p_ctx = probs[..., :ctx_len].reshape(bsz, n_kv_heads, groups * c * G, ctx_len)
            out = out + (p_ctx @ v_ctx[:, :, :ctx_len]).view_as(out)
        outs.append(out * keep_c.to(out.dtype))
    out = torch.cat(outs, dim=3)  # [B, Hkv, g, A, G, D]
    return out.reshape(bsz, n_q_heads, q_len, head_dim)
