"""The anchor sampler's statistics (the reference's, named by `SAMPLER_STATS`: drafters/kind.py;
logged as train/<name>): how many valid anchor positions a sample has, how many blocks were
sampled, how many slots each supervises.

Shape legend: B batch, S sequence length, A anchors (blocks) per sample, G = γ block size.
"""

from __future__ import annotations

import torch

from dspark_ds.drafters.dspark.blocks import (
    block_labels,
    build_anchor_candidate_mask,
)


@torch.no_grad()
def sampler_stat_sums(
    loss_mask: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_keep_mask: torch.Tensor,
    *,
    num_anchors: int,
    block_size: int,
) -> torch.Tensor:
    """fp64 [7] on the batch's device: sums over the samples of a micro-batch of each
    `SAMPLER_STATS` entry, then the sample count: divide the first six by the last (summed over
    micro-batches and ranks) for the means.

    Per sample: valid anchors (candidates, docs/algorithm.md#anchors) and that count over the batch's padded
    length S; sampled anchors (kept blocks) and that count over `num_anchors`; supervised slots
    per kept block (the eval mask's prefix length) and that over γ.
    """
    seq_len = loss_mask.shape[1]
    valid = build_anchor_candidate_mask(loss_mask).sum(dim=1).double()
    sampled = block_keep_mask.sum(dim=1).double()
    _, eval_mask = block_labels(loss_mask, anchor_positions, block_keep_mask, block_size=block_size)
    per_block = eval_mask.sum(dim=(1, 2)).double() / sampled.clamp(min=1.0)
    return torch.stack(
        [
            valid.sum(),
            (valid / max(seq_len, 1)).sum(),
            sampled.sum(),
            (sampled / max(num_anchors, 1)).sum(),
            per_block.sum(),
            (per_block / block_size).sum(),
            valid.new_tensor(float(loss_mask.shape[0])),
        ]
    )
