"""One target cache per row in flight, for a target whose cache cannot hold rows at different
positions (batched decoding, eval/batched.py).

DeepSeek-V4's compressed-sparse and heavily-compressed layers keep one compressor window
position and one entry count per layer for all rows of a cache (eval/compressed.py), so the
left-padded cache the other families' rows share (eval/padded.py) cannot hold rows at
different positions. Here each row in flight has a target cache of its own, unpadded, as the
one-row loop's (`TargetDecoder`):

- a forward runs the target once per row, on that row's L tokens at its own positions, and
  stacks the rows' logits and tapped features into what one batched forward returns
  ([R, L, V], [R, L, n*H]): row r's are exactly the one-row loop's;
- each row's forward is recorded apart (the compressed layers' states before it and their
  attention inputs, `CompressedState.take`); after the verdict each row's cache is cut back to
  its kept tokens and its compressed layers restored and replayed on them (`replay`);
- rows leaving and entering the batch take their caches (and recordings) along.

The drafter's cache stays one left-padded cache for all rows (padded.py). The cost: a round
runs R target forwards of one row instead of one forward of R rows (the target's weights are
read once per row): batching saves the drafter's passes and the loop's bookkeeping, not the
target's.

Shape legend: R rows, L new tokens per row, V vocabulary, n*H tapped features.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dspark_ds.eval.compressed import CompressedState, Recording
from dspark_ds.eval.recurrent import crop_cache
from dspark_ds.eval.target_step import forward_target


class RowCaches:
    """The target caches of the rows in flight, one each (module docstring); `states` the
    target's compressed layers, rolled back row by row (None: every forward's tokens kept)."""

    def __init__(self, caches: list[DynamicCache], states: CompressedState | None = None):
        self.caches = list(caches)
        self.states = states
        self._recorded: list[Recording | None] = [None] * len(self.caches)

    @property
    def rows(self) -> int:
        return len(self.caches)

    def forward(
        self,
        target,
        ids_RL: torch.Tensor,
        positions_RL: torch.Tensor,
        layer_ids: list[int],
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target on L new tokens per row, each row on its own cache at its positions:
        (fp32 logits [R, L or logits_to_keep, V], tapped features [R, L, n*H] or None)."""
        if ids_RL.shape[0] != self.rows:
            raise RuntimeError(f"{ids_RL.shape[0]} rows of input for {self.rows} row caches")
        logits, features = [], []
        for r, cache in enumerate(self.caches):
            args = (target, cache, ids_RL[r : r + 1], positions_RL[r : r + 1], layer_ids)
            if self.states is None:
                row_logits, row_features = forward_target(*args, logits_to_keep=logits_to_keep)
            else:
                with self.states.recording(cache):
                    row_logits, row_features = forward_target(*args, logits_to_keep=logits_to_keep)
                self._recorded[r] = self.states.take()
            logits.append(row_logits)
            features.append(row_features)
        return torch.cat(logits), torch.cat(features) if layer_ids else None

    def trim(self, keep_R: list[int], appended: int) -> None:
        """After `appended` tokens were added to every row, keep the first keep_R[r] of them."""
        for r, (cache, keep) in enumerate(zip(self.caches, keep_R, strict=True)):
            crop_cache(cache, appended - int(keep))
            recording, self._recorded[r] = self._recorded[r], None
            if self.states is not None:
                self.states.replay(cache, recording, int(keep), appended)

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order)."""
        self.caches = [self.caches[r] for r in rows]
        self._recorded = [self._recorded[r] for r in rows]

    def append(self, other: RowCaches) -> None:
        """The rows of `other` below these."""
        self.caches += other.caches
        self._recorded += other._recorded
