"""Attention with GQA under a mask every kind can build: none, a boolean tensor, or a
flex_attention BlockMask.

- None: every key visible (inference rounds, where the cache holds only context).
- a bool tensor [B, 1, Q, K]: SDPA; rows that see nothing come out exactly zero.
- a BlockMask: flex_attention, compiled once per process on CUDA (drafters/common/flex.py).

DSpark's block mask adds its own blockwise kernel (drafters/dspark/block_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_ds.drafters.common.flex import flex_attend


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

    return flex_attend(q, k, v, mask, scaling=scaling)  # compiled on CUDA
