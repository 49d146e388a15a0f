"""One round of speculative decoding as every drafter kind sees it, for R rows at once.

Both decoding loops (dspark_ds/eval/decoding.py at batch 1, dspark_ds/eval/batched.py with
several prompts in flight) use the same two methods of the drafter's kind (`DrafterKind.decode`)
(docs/algorithm.md#inference):

- `extend(drafter, VerifiedContext)` appends positions the target verified to the drafter's
  cache: batch 1 right before drafting, the batched loop right after verifying (it appends
  every verified column and trims the rejected ones with the target's cache);
- `propose(drafter, DraftRound) -> Proposal` drafts the next tokens of every row against that
  cache.

Rows of different lengths share one cache, left-padded: `key_mask` marks each row's real
columns (None: nothing is padded, as for one row). A drafter has `new_cache()`; whether it scores
its drafts, and how many it drafts at most, its kind says (`decode.has_confidence`,
`decode.tokens_per_round`).

Shape legend: R rows, L new positions, S cache columns, m drafts, V vocab, n*H tapped features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_ds.drafters.common.cache import DraftKVCache


@dataclass
class VerifiedContext:
    """Positions the target verified, to be appended to the drafter's cache."""

    features: torch.Tensor
    """[R, L, n*H] the target's tapped features of the positions."""
    positions: torch.Tensor
    """[R, L] their RoPE positions."""
    cache: DraftKVCache
    """The drafter's cache they are appended to (it holds S columns before)."""
    next_ids: torch.Tensor | None = None
    """[R, L] the committed token that follows each position (Eagle3 pairs a position's
    features with it; DSpark does not read it)."""
    key_mask: torch.Tensor | None = None
    """[R, S + L] the columns each row may attend to (left padding hidden); None: all."""
    num_kept: torch.Tensor | None = None
    """[R] how many of the L positions each row keeps (the caller trims the rest off the cache
    afterwards); None: all L."""


@dataclass
class DraftRound:
    """What a drafter knows at the start of a round."""

    x_start: torch.Tensor
    """[R] each row's last committed token."""
    starts: torch.Tensor
    """[R] its position (= the row's verified positions, all of them in the cache)."""
    cache: DraftKVCache
    """The drafter's cache; only verified context may stay in it after the round."""
    budget: int
    """The most drafts the loop can verify this round (>= 1). A drafter may propose more
    (DSpark drafts its whole block); a chain drafter stops there (Eagle3)."""
    key_mask: torch.Tensor | None = None
    """[R, S] the real (non-padding) cache columns of each row; None: all."""
    temperature: float = 0.0
    generator: torch.Generator | None = None
    stop_token_ids: set[int] = field(default_factory=set)


@dataclass
class Proposal:
    """The draft of one round."""

    tokens: torch.Tensor
    """[R, m] proposed tokens."""
    logits: torch.Tensor
    """[R, m, V] the draft distribution each token was drawn from (rejection sampling)."""
    lengths: list[int]
    """Per row, the drafts it proposes (<= m): a chain drafter ends a row at its first stop
    token (the rows of one batch chain together, so m is the longest)."""
    confidence_logits: torch.Tensor | None = None
    """[R, m] the confidence head's logits, None without one."""


def first_stop(tokens: list[int], stop_token_ids: set[int]) -> int | None:
    """Index of the first stop token in `tokens`, or None."""
    return next((i for i, token in enumerate(tokens) if token in stop_token_ids), None)
