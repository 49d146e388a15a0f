"""The caches of the rows in flight in batched decoding (eval/batched.py), left-padded.

The rows share one target KV cache (Hugging Face `DynamicCache`) and one drafter cache
(`DraftKVCache`), both *left-padded*: row r's verified positions [0, start_r) occupy the last
start_r cache columns, and `pad[r]` columns of zeros precede them. Cache index i of row r holds
position i - pad[r], so relative distances, and with them sliding windows (Gemma4), are those
of an unpadded row; a 2-D attention mask hides the padding and RoPE gets the real positions.

After a verification every row has M + 1 new columns and keeps a_r + 1 of them: its rejected
columns are dropped by shifting the row right by (its drop - the smallest drop) and cropping
the smallest drop off every row, so the row stays right-aligned and its padding grows. Padding
every row shares is cut off again.

A sparse-attention target's indexer keys (DeepSeek-V3.2, GLM-5: `DynamicIndexedLayer`) are one
more column per token beside a layer's keys and values, moved with them. A hybrid target's
recurrent layers have no columns: their per-row states are snapshotted
before each forward and, after the verdict, replayed up to each row's kept columns
(eval/recurrent.py); rows leaving or entering the batch take their states along.

A target whose cache cannot hold rows at different positions (DeepSeek-V4's compressed
attention) has one target cache per row instead, unpadded, and runs row by row
(eval/row_caches.py, `new_caches` picks); the drafter's cache is padded as above.

Shape legend: R rows, S cache columns, h heads, D head dim, L new tokens per row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import DynamicCache

from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.eval.compressed import CompressedState, needs_row_caches
from dspark_ds.eval.recurrent import RecurrentState, crop_cache, row_states
from dspark_ds.eval.row_caches import RowCaches
from dspark_ds.eval.target_step import forward_target, new_target_cache


def _shift_rows_right(x: torch.Tensor, shift_R: torch.Tensor) -> torch.Tensor:
    """x [R, h, S, D]: row r moved right by shift_R[r] columns along S, zeros entering left."""
    if not bool((shift_R > 0).any()):
        return x
    length = x.shape[2]
    src = torch.arange(length, device=x.device).unsqueeze(0) - shift_R.unsqueeze(1)  # [R, S]
    out = x.gather(2, src.clamp(min=0)[:, None, :, None].expand_as(x))
    return out * (src >= 0)[:, None, :, None].to(x.dtype)


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    if n <= 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)


class _Slots(ABC):
    """The per-layer column tensors of one cache ([R, h, S, D]: keys, values, and what else a
    layer keeps per token), as `PaddedCaches` moves them."""

    @abstractmethod
    def tensors(self):
        """(layer, its column tensors) of every layer that holds any."""

    @abstractmethod
    def put(self, i: int, columns: tuple[torch.Tensor, ...]) -> None: ...

    def stored(self, i: int, total: int) -> int:
        """Columns layer i keeps when the index space holds `total`."""
        return total

    @abstractmethod
    def set_total(self, total: int) -> None:
        """The index space now holds `total` columns."""

    @abstractmethod
    def crop_end(self, n: int, total: int) -> None:
        """Drop the last n of `total` columns."""

    def select_rows(self, index: torch.Tensor) -> None:
        for i, columns in self.tensors():
            self.put(i, tuple(x.index_select(0, index) for x in columns))

    def append_rows(self, other: _Slots) -> None:
        theirs = dict(other.tensors())
        for i, columns in list(self.tensors()):
            self.put(i, tuple(torch.cat([x, y]) for x, y in zip(columns, theirs[i], strict=True)))


class _DraftSlots(_Slots):
    """A `DraftKVCache` (full attention, every column stored) and its per-row `last_hidden`."""

    def __init__(self, cache: DraftKVCache):
        self.cache = cache

    def tensors(self):
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            if k is not None:
                yield i, (k, v)

    def put(self, i, columns):
        self.cache.keys[i], self.cache.values[i] = columns

    def set_total(self, total: int) -> None:
        pass  # a DraftKVCache has no running count: its tensors' length is the count

    def crop_end(self, n: int, total: int) -> None:
        self.cache.crop(total - n)

    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)
        if self.cache.last_hidden is not None:
            self.cache.last_hidden = self.cache.last_hidden.index_select(0, index)

    def append_rows(self, other: _Slots) -> None:
        super().append_rows(other)
        if self.cache.last_hidden is not None:
            self.cache.last_hidden = torch.cat([self.cache.last_hidden, other.cache.last_hidden])


class _TargetSlots(_Slots):
    """A Hugging Face `DynamicCache` (full and sliding-window layers; a sparse-attention layer's
    indexer keys [R, S, D] as a third column tensor [R, 1, S, D])."""

    def __init__(self, cache: DynamicCache):
        self.cache = cache

    def tensors(self):
        for i, layer in enumerate(self.cache.layers):
            if getattr(layer, "is_initialized", False) and layer.keys is not None:
                if getattr(layer, "is_indexer_initialized", False):
                    yield i, (layer.keys, layer.values, layer.indexer_keys.unsqueeze(1))
                else:
                    yield i, (layer.keys, layer.values)

    def put(self, i, columns):
        layer = self.cache.layers[i]
        layer.keys, layer.values = columns[:2]
        if len(columns) == 3:
            layer.indexer_keys = columns[2].squeeze(1)

    def stored(self, i, total: int) -> int:
        layer = self.cache.layers[i]
        if getattr(layer, "is_sliding", False):
            return min(total, int(layer.sliding_window) - 1)
        return total

    def set_total(self, total: int) -> None:
        for layer in self.cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = total
            if getattr(layer, "cumulative_length_linear", None) is not None:  # transformers 5.25
                layer.cumulative_length_linear.fill_(total)

    def crop_end(self, n: int, total: int) -> None:
        # NOTE: this also trims sliding-window layers back to their window (even n = 0).
        crop_cache(self.cache, n)

    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)
        for states, s in row_states(self.cache):
            states[s] = states[s].index_select(0, index)

    def append_rows(self, other: _Slots) -> None:
        super().append_rows(other)
        theirs = list(row_states(other.cache))
        for (states, s), (other_states, _) in zip(row_states(self.cache), theirs, strict=True):
            states[s] = torch.cat([states[s], other_states[s]])


class PaddedCaches:
    """The target and drafter caches of the rows in flight, left-padded to `length` columns
    (a `RowCaches` target cache: one per row, unpadded)."""

    def __init__(
        self,
        target_cache: DynamicCache | RowCaches,
        draft_cache: DraftKVCache | None,
        states: RecurrentState | None = None,
    ):
        self.rows_apart = isinstance(target_cache, RowCaches)
        self.slots: list[_Slots] = [] if self.rows_apart else [_TargetSlots(target_cache)]
        if draft_cache is not None:
            self.slots.append(_DraftSlots(draft_cache))
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.states = states
        """A hybrid target's recurrent layers (None: a KV cache only, or not rolled back)."""
        self.length = 0
        self.pad: torch.Tensor | None = None  # [R] long

    @property
    def rows(self) -> int:
        return 0 if self.pad is None else int(self.pad.shape[0])

    def key_mask(self) -> torch.Tensor:
        """[R, length] bool: the real (non-padding) columns of each row."""
        cols = torch.arange(self.length, device=self.pad.device)
        return cols.unsqueeze(0) >= self.pad.unsqueeze(1)

    def starts(self) -> torch.Tensor:
        """[R]: each row's number of verified positions (= the position of its x_start)."""
        return self.length - self.pad

    def trim(self, keep_R: torch.Tensor, appended: int) -> None:
        """After `appended` columns were added to every row, keep the first keep_R[r] of them."""
        drop = appended - keep_R
        common = int(drop.min())
        shift = drop - common
        total = self.length + appended
        for slots in self.slots:
            for i, columns in slots.tensors():
                slots.put(i, tuple(_shift_rows_right(x, shift) for x in columns))
            slots.crop_end(common, total)
        self.length = total - common
        self.pad = self.pad + shift
        if self.rows_apart:
            self.target_cache.trim(keep_R.tolist(), appended)
        elif self.states is not None:
            self.states.rollback(self.target_cache, keep_R.tolist(), appended)
        self._drop_common_padding()

    def _drop_common_padding(self) -> None:
        n = int(self.pad.min()) if self.rows else 0
        if n <= 0:
            return
        for slots in self.slots:
            for i, columns in slots.tensors():
                # a sliding layer keeps only the last columns: cut just what it holds of the n
                cut = max(0, n - (self.length - columns[0].shape[2]))
                slots.put(i, tuple(x[:, :, cut:] for x in columns))
            slots.set_total(self.length - n)
        self.length -= n
        self.pad = self.pad - n

    def _pad_to(self, total: int) -> None:
        n = total - self.length
        if n <= 0:
            return
        for slots in self.slots:
            for i, columns in slots.tensors():
                extra = slots.stored(i, total) - columns[0].shape[2]
                slots.put(i, tuple(_left_pad(x, extra) for x in columns))
            slots.set_total(total)
        self.length = total
        self.pad = self.pad + n

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.pad.device)
        for slots in self.slots:
            slots.select_rows(index)
        if self.rows_apart:
            self.target_cache.select(rows)
        self.pad = self.pad.index_select(0, index)
        if not rows:
            self.length = 0
        self._drop_common_padding()

    def add(self, other: PaddedCaches) -> None:
        """Append the rows of `other` (a fresh prefill) below the rows in flight."""
        if self.rows == 0:  # adopt the fresh caches as they are
            self.slots, self.length, self.pad = other.slots, other.length, other.pad.clone()
            self.target_cache, self.draft_cache = other.target_cache, other.draft_cache
            return
        total = max(self.length, other.length)
        self._pad_to(total)
        other._pad_to(total)
        for mine, theirs in zip(self.slots, other.slots, strict=True):
            mine.append_rows(theirs)
        if self.rows_apart:
            self.target_cache.append(other.target_cache)
        self.pad = torch.cat([self.pad, other.pad])


def new_caches(
    target,
    draft_cache: DraftKVCache | None,
    states: RecurrentState | CompressedState | None = None,
    rows: int = 1,
) -> PaddedCaches:
    """Empty caches for `rows` rows: one target cache they share, or one per row for a target
    whose cache cannot hold rows at different positions (DeepSeek-V4: eval/row_caches.py, its
    compressed layers rolled back row by row with `states`)."""
    if needs_row_caches(target.config):
        caches = [new_target_cache(target) for _ in range(rows)]
        return PaddedCaches(RowCaches(caches, states), draft_cache)
    return PaddedCaches(new_target_cache(target), draft_cache, states)


@torch.inference_mode()
def target_forward(
    target,
    caches: PaddedCaches,
    ids_RL: torch.Tensor,
    layer_ids: list[int],
    logits_to_keep: int = 0,
):
    """The target on L new tokens per row, appended after the cached columns (the padding
    masked, each row at its own positions): (fp32 logits [R, L or logits_to_keep, V], tapped
    features [R, L, n*H] or None). `caches.trim` decides which new columns stay."""
    rows, length = ids_RL.shape
    positions = caches.starts().unsqueeze(1) + torch.arange(length, device=ids_RL.device)
    if caches.rows_apart:  # (one forward per row, nothing padded)
        return caches.target_cache.forward(target, ids_RL, positions, layer_ids, logits_to_keep)
    mask = torch.cat([caches.key_mask(), caches.key_mask().new_ones(rows, length)], dim=1)
    args = (target, caches.target_cache, ids_RL, positions, layer_ids)
    kwargs = dict(attention_mask=mask.long(), logits_to_keep=logits_to_keep)
    if caches.states is None:
        return forward_target(*args, **kwargs)
    with caches.states.recording(caches.target_cache):
        return forward_target(*args, **kwargs)
