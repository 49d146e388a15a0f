"""DSpark's block attention: the block mask's visibility (docs/algorithm.md#the-block-mask) and
the attention kernels that apply it.

Query = draft slot of block qb; key index kv runs over [context (S); drafts (A*G)]:
    visible = (kv < S and kv < anchor[qb]) or (kv >= S and (kv - S) // G == qb)
    visible = visible and block_keep_mask[qb]

Implementations, chosen by `attn_implementation`:
- "dense": a [B, 1, A*G, S+A*G] boolean mask and SDPA. Works everywhere with autograd; kept
  as the plain reference (it computes every masked score too).
- "blockwise": exact, computes only what the mask can show: each chunk of blocks attends to
  the context prefix up to its largest anchor plus its own G x G block, in one softmax. The
  CPU training path (flex_attention has no backward on CPU).
- "flex": a flex_attention BlockMask built from the anchors, and flex_attention compiled once
  per process on CUDA (flex_mask.py, drafters/common/flex.py; GPU training; forward-only on
  CPU, uncompiled there).
A None mask or a bool tensor goes to the kernels every kind shares (drafters/common/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_ds.drafters.common import attention
from dspark_ds.drafters.dspark.flex_mask import dspark_block_mask
from dspark_ds.drafters.perf import ATTN_IMPLEMENTATIONS

# Blocks per chunk of the blockwise path: small enough that the context cut follows the
# anchors closely (sorted anchors), large enough that per-chunk overhead stays negligible.
BLOCKWISE_CHUNK_BLOCKS = 16


@dataclass
class BlockwiseMask:
    """The block-mask visibility in its factored form (no [Q, K] tensor is ever built)."""

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
    """The same visibility as a flex_attention BlockMask, built from the anchors in O(tiles)
    (flex_mask.py)."""
    return dspark_block_mask(
        anchor_positions, block_keep_mask, seq_len=seq_len, block_size=block_size
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
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D] (GQA), mask None | bool tensor | BlockMask |
    BlockwiseMask (`build_block_mask`).

    Returns [B, Hq, Q, D]; rows that see nothing are exactly zero.
    """
    if isinstance(mask, BlockwiseMask):
        return blockwise_attend(q, k, v, mask, scaling=scaling)
    return attention.attend(q, k, v, mask, scaling=scaling)


def blockwise_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockwiseMask, *, scaling: float
) -> torch.Tensor:
    """Exact block-mask attention without the masked work of the dense path.

    For a chunk of blocks, the visible keys are the context prefix [0, max anchor) and each
    block's own G draft keys: one [.., c*G, L + G] score tensor (context scores next to the
    block's own G x G scores) and one softmax, instead of [.., A*G, S + A*G].
    q [B, Hq, A*G, D], k/v [B, Hkv, S + A*G, D] -> [B, Hq, A*G, D].
    """
    if k.shape[2] != mask.seq_len + q.shape[2]:
        raise ValueError(
            f"blockwise attention: {k.shape[2]} keys, expected S + A*G = "
            f"{mask.seq_len + q.shape[2]}"
        )
    save = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _BlockwiseAttention.apply(q, k, v, mask, scaling, save)


class _BlockwiseAttention(torch.autograd.Function):
    """Forward and a hand-written backward over the same chunks.

    Backward recomputes each chunk's scores from q, k and the saved per-row log-sum-exp
    (flash-attention style) instead of keeping every chunk's probabilities alive.
    NOTE: with plain autograd, every chunk's `k[..., :L]` slice would also get a full-size
    zero gradient (SliceBackward), summed chunk after chunk — more memory traffic than the
    attention itself. Here the chunks accumulate straight into one dK / dV.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask: BlockwiseMask, scaling: float, save: bool):
        lay = _Layout(q, k, mask)
        qr, k_ctx, v_ctx, k_own, v_own = lay.split(q, k, v)
        out = q.new_empty(lay.out_shape)
        # Half-precision scores are normalised in fp32 (as SDPA does internally).
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        lse = torch.empty(lay.out_shape[:-1], dtype=acc, device=q.device)
        for a0, a1, L in lay.chunks:
            scores = lay.scores(qr, k_ctx, k_own, a0, a1, L, scaling).to(acc)
            lse[:, :, :, a0:a1] = torch.logsumexp(scores, dim=-1)
            p = torch.softmax(scores, dim=-1).to(q.dtype)
            o = p[..., L:] @ v_own[:, :, :, a0:a1]
            if L > 0:
                o += (lay.rows(p[..., :L]) @ v_ctx[:, :, :L]).view_as(o)
            out[:, :, :, a0:a1] = o * lay.keep(a0, a1).to(o.dtype)
        if save:
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.lay, ctx.scaling = lay, scaling
        return out.view(lay.q_shape)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        lay, scaling = ctx.lay, ctx.scaling
        qr, k_ctx, v_ctx, k_own, v_own = lay.split(q, k, v)
        d_out = grad_out.reshape(lay.out_shape)
        dq = torch.empty_like(qr)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk_ctx, dv_ctx = dk[:, :, : lay.S], dv[:, :, : lay.S]
        dk_own = dk[:, :, lay.S :].view(lay.own_shape)[:, :, 0]  # [B, Hkv, A, G, D]
        dv_own = dv[:, :, lay.S :].view(lay.own_shape)[:, :, 0]
        qkv, grads = (qr, k_ctx, v_ctx, k_own, v_own), (dk_ctx, dv_ctx, dk_own, dv_own)
        for a0, a1, L in lay.chunks:
            # NOTE: one call per chunk, so that a chunk's scores, probabilities and their
            # gradients are freed before the next chunk's exist (loop variables would keep them)
            dq[:, :, :, a0:a1] = _chunk_backward(
                lay, qkv, grads, d_out, out, lse, a0, a1, L, scaling
            )
        return dq.view(lay.q_shape), dk, dv, None, None, None


def _chunk_backward(lay, qkv, grads, d_out, out, lse, a0: int, a1: int, L: int, scaling: float):
    """One chunk of `_BlockwiseAttention.backward`: adds its keys' gradients into `grads` (dK /
    dV of the context and of the own blocks) and returns its queries' gradient."""
    qr, k_ctx, v_ctx, k_own, v_own = qkv
    dk_ctx, dv_ctx, dk_own, dv_own = grads
    q_c = qr[:, :, :, a0:a1]
    scores = lay.scores(qr, k_ctx, k_own, a0, a1, L, scaling)
    p = (scores.to(lse.dtype) - lse[:, :, :, a0:a1, :, None]).exp_().to(qr.dtype)
    del scores
    do = d_out[:, :, :, a0:a1] * lay.keep(a0, a1).to(d_out.dtype)
    delta = (do * out[:, :, :, a0:a1]).sum(-1, keepdim=True)
    dp = do @ v_own[:, :, :, a0:a1].transpose(-1, -2)  # [B, Hkv, g, c, G, G]
    if L > 0:
        dp_ctx = (lay.rows(do) @ v_ctx[:, :, :L].transpose(-1, -2)).view(*dp.shape[:-1], L)
        dp = torch.cat([dp_ctx, dp], dim=-1)
        del dp_ctx
    ds = dp.sub_(delta).mul_(p).mul_(scaling)  # masked entries have p = 0
    ds_own, p_own = ds[..., L:], p[..., L:]
    dq_c = ds_own @ k_own[:, :, :, a0:a1]
    dk_own[:, :, a0:a1] += (ds_own.transpose(-1, -2) @ q_c).sum(2)
    dv_own[:, :, a0:a1] += (p_own.transpose(-1, -2) @ do).sum(2)
    if L > 0:
        ds_ctx = lay.rows(ds[..., :L])
        dq_c += (ds_ctx @ k_ctx[:, :, :L]).view_as(dq_c)
        dk_ctx[:, :, :L] += ds_ctx.transpose(-1, -2) @ lay.rows(q_c)
        dv_ctx[:, :, :L] += lay.rows(p[..., :L]).transpose(-1, -2) @ lay.rows(do)
    return dq_c


class _Layout:
    """Shapes and chunking of one blockwise attention call (GQA: q head h uses kv h // g)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mask: BlockwiseMask):
        bsz, n_q_heads, q_len, head_dim = q.shape
        self.B, self.Hkv, self.D = bsz, k.shape[1], head_dim
        self.g = n_q_heads // self.Hkv
        self.G, self.S = mask.block_size, mask.seq_len
        self.A = q_len // self.G
        self.q_shape = q.shape
        self.out_shape = (bsz, self.Hkv, self.g, self.A, self.G, head_dim)
        self.own_shape = (bsz, self.Hkv, 1, self.A, self.G, head_dim)
        self.anchors, self.keep_mask = mask.anchor_positions, mask.block_keep_mask
        # NOTE: a dummy block (keep False) would see nothing: open its row to every key it is
        # offered (finite softmax), then zero its output, as the dense path does.
        max_ctx = torch.where(self.keep_mask, self.anchors, torch.zeros_like(self.anchors))
        max_ctx = max_ctx.clamp(max=self.S)
        splits = max_ctx.split(mask.chunk_blocks, dim=1)
        lengths = torch.stack([c.max() for c in splits]).tolist()  # one host sync
        starts = range(0, self.A, mask.chunk_blocks)
        self.chunks = [(a0, a0 + c.shape[1], int(L)) for a0, c, L in zip(starts, splits, lengths)]

    def split(self, q, k, v):
        S = self.S
        own = self.own_shape
        return (
            q.reshape(self.out_shape),
            k[:, :, :S],
            v[:, :, :S],
            k[:, :, S:].reshape(own),
            v[:, :, S:].reshape(own),
        )

    def scores(self, qr, k_ctx, k_own, a0: int, a1: int, L: int, scaling: float):
        """Scaled scores of chunk [a0, a1): [B, Hkv, g, c, G, L + G], hidden keys -inf."""
        q_c = qr[:, :, :, a0:a1]
        scores = q_c @ k_own[:, :, :, a0:a1].transpose(-1, -2)  # [B, Hkv, g, c, G, G]
        if L > 0:
            s_ctx = self.rows(q_c) @ k_ctx[:, :, :L].transpose(-1, -2)
            s_ctx = s_ctx.view(*scores.shape[:-1], L)
            s_ctx.masked_fill_(~self.visible(a0, a1, L), float("-inf"))
            scores = torch.cat([s_ctx, scores], dim=-1)
        return scores.mul_(scaling)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, g, c, G, X] -> [B, Hkv, g*c*G, X] (every query row of the chunk)."""
        return x.reshape(self.B, self.Hkv, -1, x.shape[-1])

    def keep(self, a0: int, a1: int) -> torch.Tensor:
        return self.keep_mask[:, a0:a1].view(self.B, 1, 1, a1 - a0, 1, 1)

    def visible(self, a0: int, a1: int, L: int) -> torch.Tensor:
        cols = torch.arange(L, device=self.anchors.device)
        anchor = self.anchors[:, a0:a1].view(self.B, 1, 1, a1 - a0, 1, 1)
        return (cols < anchor) | ~self.keep(a0, a1)
