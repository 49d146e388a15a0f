"""The reference's anchor-sampler statistics (train/valid_anchors_abs, ...) on a hand-made batch."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.drafters.dspark.sampler_stats import sampler_stat_sums
from dspark_ds.drafters.kind import SAMPLER_STATS


def test_sampler_stats_by_hand():
    # Sample 0: supervised 2..9 -> candidates 2..8 (7). Sample 1: supervised 5..7 -> 5, 6 (2);
    # positions 10, 11 are padding.
    loss_mask = torch.zeros(2, 12, dtype=torch.long)
    loss_mask[0, 2:10] = 1
    loss_mask[1, 5:8] = 1
    # Sample 0 keeps 3 blocks (anchors 2, 5, 8), sample 1 both candidates and one dummy block.
    anchors = torch.tensor([[2, 5, 8], [5, 6, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    sums = sampler_stat_sums(loss_mask, anchors, keep, num_anchors=3, block_size=4).tolist()
    assert len(sums) == len(SAMPLER_STATS) + 1 and sums[-1] == 2
    # Supervised slots (label p + j + 1 supervised, as a prefix): anchor 2 -> 3,4,5,6: 4;
    # anchor 5 -> 6,7,8,9: 4; anchor 8 -> 9 only: 1; anchor 5 (sample 1) -> 6, 7: 2; anchor 6 -> 7: 1.
    per_block = [(4 + 4 + 1) / 3, (2 + 1) / 2]
    expected = [
        7 + 2,
        7 / 12 + 2 / 12,
        3 + 2,
        3 / 3 + 2 / 3,
        sum(per_block),
        sum(per_block) / 4,
    ]
    assert sums[:-1] == pytest.approx(expected)
