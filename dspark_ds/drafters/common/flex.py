"""flex_attention compiled once per process: the kernel of every kind's flex attention path
(DSpark's block mask, drafters/dspark/flex_mask.py; Eagle3's unrolled steps, drafters/eagle3/
model.py).

Called without torch.compile, flex_attention runs an unfused fallback that materialises the whole
score matrix (3.5x slower than dense SDPA on an H200, docs/performance.md). `flex_attend` uses one
`torch.compile(flex_attention)` per process on CUDA. Varying shapes: the trainer pads each batch
to its longest sample, so the key length (DSpark: S + A*G) changes from batch to batch while the
draft part stays fixed. A mask_mod reads S only through tensors it captures (never a Python int,
which dynamo would specialise on, recompiling for every length), and the key length and key-tile
counts are marked dynamic. The first call compiles for its shapes; the first call with another
key length recompiles once with them symbolic, and no call after that recompiles: 2 graphs per
grad mode (training; validation under no_grad), within dynamo's recompile limit (8).
tests/unit/test_perf_flex.py counts them on CPU. Bucketing S to a multiple of the tile instead
would still leave up to max_length / 128 static shapes, more than that limit. On CPU the eager
fallback stays the default: flex_attention has no CPU backward (training there uses DSpark's
blockwise kernel or Eagle3's dense one), and compiling its forward costs ~20 s of C++ builds.
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
