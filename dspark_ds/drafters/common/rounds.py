"""One drafting round of speculative decoding, as every drafter kind sees it (batch 1).

The decoding loop (dspark_ds/eval/decoding.py) hands a drafter a `DraftRound` and verifies the
`Proposal` it returns; each kind's `propose_round` is what differs (docs/algorithm.md#inference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_ds.drafters.common.blocks import DraftKVCache


@dataclass
class DraftRound:
    """What a drafter knows at the start of a round."""

    committed_ids: torch.Tensor
    """[1, start + 1] every committed token (prompt and generated); x_start is the last."""
    context_features: torch.Tensor
    """[1, start - cache.seq_length, n*H] the target's tapped features of the positions verified
    since the previous round (the drafter's cache holds the ones before)."""
    cache: DraftKVCache
    """The drafter's own KV cache; only verified context may stay in it after the round."""
    budget: int
    """The most draft tokens the loop can verify this round (>= 1). A drafter may propose more
    (DSpark drafts its whole block); the loop verifies the first `budget`."""
    temperature: float = 0.0
    generator: torch.Generator | None = None
    stop_token_ids: set[int] = field(default_factory=set)

    @property
    def start(self) -> int:
        """Position of x_start, the last committed token."""
        return self.committed_ids.shape[1] - 1


@dataclass
class Proposal:
    """The draft of one round."""

    tokens: torch.Tensor
    """[1, m] proposed tokens."""
    logits: torch.Tensor
    """[1, m, V] the draft distribution each token was drawn from (rejection sampling)."""
    confidence_logits: torch.Tensor | None = None
    """[1, m] the confidence head's logits, None without one."""
