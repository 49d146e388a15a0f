"""Block attention visibility (spec §4) and the attention kernels that apply it.

Query = draft slot of block qb; key index kv runs over [context (S); drafts (A*G)]:
    visible = (kv < S and kv < anchor[qb]) or (kv >= S and (kv - S) // G == qb)
    visible = visible and block_keep_mask[qb]

Three implementations, chosen by `attn_implementation`:
- "dense": a [B, 1, A*G, S+A*G] boolean mask and SDPA. Works everywhere with autograd; the
  CPU training path (flex_attention has no backward on CPU).
- "flex": a flex_attention BlockMask (GPU training; forward-only on CPU).
- None mask: every key visible (inference rounds, where the cache holds only context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATIONS = ("dense", "flex")


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
